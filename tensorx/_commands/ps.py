"""``tensorx ps``: run parameter-server shards as a long-lived asyncio service.

    tensorx ps --listen tcp://0.0.0.0:7000 --workers 2 --mode sync \\
               --optimizer "sgd:lr=0.05,momentum=0.9" --checkpoint-dir ckpt/

Logs to stderr, prints each shard's address on stdout, and on SIGTERM or SIGINT writes a
checkpoint (with ``--checkpoint-dir``) and exits 0; started again with the same directory it
resumes (the checkpoint's optimizer state and hyperparameters win over ``--optimizer``'s, as
with torch's ``load_state_dict``; ``--no-resume-optimizer``: the parameters alone); killed
(SIGKILL, a crash), it resumes from the last ``--checkpoint-every`` checkpoint and workers
started with ``reconnect`` rejoin it. ``--on-worker-loss`` says what
a sync barrier does once a worker has been gone ``--worker-loss-timeout`` seconds: keep
waiting for it (``wait``, the default) or go on with the others (``continue``, which also
goes on without a connected worker that has not pushed that long after the barrier's
first push).
``--shards N`` runs N shards in this process (ports PORT..PORT+N-1), ``--shard I``
only shard I (one process per shard). ``--rendezvous`` publishes the addresses in the
torchrun store (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) for workers.
The token comes from ``--token`` or, better (not visible in ``ps``), ``$TENSORX_TOKEN``.
``--metrics-port N`` serves every shard's step timings and endpoint counters for Prometheus
(one exporter per process; port 0: any free port, printed on stdout as
``tensorx ps metrics on http://ADDR:PORT/metrics``). It runs on uvloop where installed
(``pip install 'tensorx-rdma[uvloop]'``; ``--loop asyncio`` or ``TENSORX_LOOP=asyncio`` not).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn
from urllib.parse import urlsplit

from tensorx import _eventloop
from tensorx._eventloop import LOOPS
from tensorx._ps.common.device import resolve as resolve_device
from tensorx._ps.service.losses import POLICIES
from tensorx.errors import TensorxError, UsageError
from tensorx.metrics import serve_prometheus, stop_prometheus

__all__ = ["add_parser", "main", "parse_lr_scheduler", "parse_optimizer", "run"]

logger = logging.getLogger(__name__)


def add_parser(subparsers: Any) -> None:
    """Register the ``ps`` command on an ``argparse`` subparsers object."""
    parser = subparsers.add_parser(
        "ps", help="run parameter-server shards",
        description=__doc__.splitlines()[0] if __doc__ else None)
    _arguments(one_line_errors(parser))
    parser.set_defaults(func=run)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", type=_listen, default="tcp://0.0.0.0:7000",
                   help="address of shard 0; shard i listens on PORT+i (port 0: any)")
    p.add_argument("--workers", type=_count(1), required=True,
                   help="number of workers (ranks)")
    p.add_argument("--mode", choices=("sync", "async", "bounded"), default="sync")
    p.add_argument("--staleness", type=_count(0), default=1,
                   help="bounded mode: max steps ahead")
    p.add_argument("--shards", type=_count(1), default=1, help="total number of shards")
    p.add_argument("--shard", type=_count(0), default=None, help="run only this shard")
    p.add_argument("--optimizer", default="sgd:lr=0.1",
                   help='torch.optim class and arguments, e.g. "adam:lr=1e-3"')
    p.add_argument("--lr-scheduler", default=None,
                   help='torch.optim.lr_scheduler class and arguments, stepped per update, '
                        'e.g. "steplr:step_size=1000,gamma=0.5"')
    p.add_argument("--flat", action=argparse.BooleanOptionalAction, default=None,
                   help="default: a flat update over the arena when the optimizer is "
                        "elementwise (same result, faster), else per tensor; --no-flat: "
                        "always per tensor; --flat: the optimizer sees flat parameters")
    p.add_argument("--clip-grad-norm", type=float, default=None, metavar="MAX_NORM",
                   help="sync mode: clip the averaged gradient to this 2-norm over all shards, "
                        "as torch.nn.utils.clip_grad_norm_ would on one process")
    p.add_argument("--checkpoint-dir", default=None, help="checkpoint here; resume from here")
    p.add_argument("--checkpoint-every", type=_count(1), default=None,
                   help="updates between saves")
    p.add_argument("--checkpoint-keep", type=_count(1), default=2,
                   help="checkpoints kept; a damaged newest one falls back to the one before "
                        "(default 2)")
    p.add_argument("--resume-optimizer", action=argparse.BooleanOptionalAction, default=True,
                   help="resuming from --checkpoint-dir: restore the optimizer's state, its "
                        "hyperparameters (the checkpoint's lr wins over --optimizer's) and the "
                        "LR schedule (default), or the parameters alone, with a fresh "
                        "--optimizer (--no-resume-optimizer)")
    p.add_argument("--exit-when-done", action="store_true",
                   help="checkpoint and exit 0 once every worker has said goodbye (closed "
                        "its Worker or RemoteOptimizer); a crashed worker has not")
    p.add_argument("--on-worker-loss", choices=POLICIES, default="wait",
                   help="sync mode, once a worker has been disconnected --worker-loss-timeout "
                        "seconds: keep waiting for it to rejoin (wait) or complete barriers "
                        "with the connected workers until it does (continue; a connected "
                        "worker that has not pushed that long after a barrier's first push "
                        "is lost too); one WARNING either way")
    p.add_argument("--worker-loss-timeout", type=_seconds_or_none, default=30.0,
                   help="seconds (default 30; 'none': wait silently forever)")
    p.add_argument("--send-timeout", type=_seconds_or_none, default=10.0,
                   help="seconds a worker may take to receive its parameters (default 10; "
                        "'none': no limit); one that takes longer (stopped, hung) is dropped "
                        "and rejoins if it can, so it holds the others up at most this long")
    p.add_argument("--on-nonfinite", choices=("skip", "refuse"), default="skip",
                   help="a pushed gradient holding NaN or Inf is never applied: skip that "
                        "step's update (skip) or refuse the push and disconnect its worker "
                        "(refuse); one WARNING naming the rank either way")
    p.add_argument("--token", default=None, help="shared secret (default $TENSORX_TOKEN)")
    p.add_argument("--insecure", action="store_true",
                   help="listen beyond loopback without a token (trusted networks only)")
    p.add_argument("--transport", choices=("auto", "tcp", "ucx"), default="auto")
    p.add_argument("--rendezvous", action="store_true",
                   help="publish addresses in the torchrun TCPStore")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--loop", choices=LOOPS, default=None,
                   help="event loop: uvloop where installed (auto, the default, or "
                        "$TENSORX_LOOP), or asyncio's own")
    p.add_argument("--pipeline", action=argparse.BooleanOptionalAction, default=None,
                   help="sync rounds of a flat update in parts: apply each part as soon as "
                        "every worker's has landed (--pipeline) or once the whole gradient "
                        "is in (--no-pipeline); default: measure both, keep the faster")
    p.add_argument("--share-memory", action=argparse.BooleanOptionalAction, default=True,
                   help="sync mode: let workers on this host map the arenas (zero-copy); "
                        "--no-share-memory always copies, as across hosts")
    p.add_argument("--device", default="cpu",
                   help="where each shard keeps its parameters, gradient slots and optimizer "
                        "state and runs the update: cpu (default), cuda (the current GPU) "
                        "or cuda:N")
    p.add_argument("--log-every", type=_seconds, default=60.0,
                   help="seconds between throughput log lines (0: never)")
    p.add_argument("--metrics-port", type=_port, default=None,
                   help="serve Prometheus metrics on this port (0: any free port; "
                        "default: off)")
    p.add_argument("--metrics-addr", default="127.0.0.1",
                   help="address the metrics port listens on (0.0.0.0: every interface)")


def _count(least: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``least``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}")
        return value
    return parse


def _port(text: str) -> int:
    value = _count(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"port {value} outside 0..65535")
    return value


def _listen(text: str) -> str:
    """tcp://HOST:PORT or ucx://HOST:PORT (or HOST:PORT), checked now."""
    try:
        parts = urlsplit(text if "://" in text else f"tcp://{text}")
        port = parts.port
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad address {text!r}: {exc}") from None
    if parts.scheme not in ("tcp", "ucx") or not parts.hostname or port is None:
        raise argparse.ArgumentTypeError(f"bad address {text!r}: expected tcp://HOST:PORT")
    return text


def _seconds(text: str) -> float:
    value = _seconds_or_none(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


def _seconds_or_none(text: str) -> float | None:
    if text.strip().lower() in ("none", "off", "never"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds or 'none', got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


def parse_optimizer(spec: str) -> Callable[[list[Any]], Any]:
    """``"adam:lr=1e-3,betas=(0.9,0.99)"`` -> ``lambda params: torch.optim.Adam(params, ...)``.

    Values are Python literals (``ast.literal_eval``): nothing is executed.
    """
    import torch  # noqa: PLC0415 (optional dependency: when the subcommand runs)

    name, _, rest = spec.partition(":")
    classes = {n.lower(): getattr(torch.optim, n) for n in dir(torch.optim)
               if isinstance(getattr(torch.optim, n), type)
               and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)}
    cls = classes.get(name.strip().lower())
    if cls is None:
        raise UsageError(f"unknown optimizer {name!r}; one of {', '.join(sorted(classes))}")
    kwargs = _literal_kwargs(rest)
    try:  # fail now on a bad argument, not in the middle of the first handshake
        cls([torch.zeros(1, requires_grad=True)], **kwargs)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"optimizer {spec!r}: {exc}") from None
    return lambda params: cls(params, **kwargs)


def parse_lr_scheduler(spec: str | None) -> Callable[[Any], Any] | None:
    """``"steplr:step_size=100,gamma=0.5"`` -> ``lambda opt: StepLR(opt, ...)`` (or None)."""
    if not spec:
        return None
    import torch  # noqa: PLC0415 (optional dependency: when the subcommand runs)

    sched = torch.optim.lr_scheduler
    name, _, rest = spec.partition(":")
    classes = {n.lower(): getattr(sched, n) for n in dir(sched)
               if isinstance(getattr(sched, n), type)
               and issubclass(getattr(sched, n), sched.LRScheduler)}
    cls = classes.get(name.strip().lower())
    if cls is None:
        raise UsageError(f"unknown lr scheduler {name!r}; one of {', '.join(sorted(classes))}")
    kwargs = _literal_kwargs(rest)
    try:  # fail now on a bad argument, on a throwaway optimizer
        cls(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), **kwargs)
    except (TypeError, ValueError, KeyError) as exc:
        raise UsageError(f"lr scheduler {spec!r}: {exc}") from None
    return lambda opt: cls(opt, **kwargs)


def _literal_kwargs(text: str) -> dict[str, Any]:
    if not text.strip():
        return {}
    try:
        call = ast.parse(f"f({text})", mode="eval").body
    except SyntaxError as exc:
        raise UsageError(f"bad optimizer arguments {text!r}: {exc.msg}") from exc
    if not isinstance(call, ast.Call) or call.args:
        raise UsageError(f"optimizer arguments must be name=value pairs, got {text!r}")
    try:
        return {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg}
    except ValueError as exc:
        raise UsageError(f"optimizer arguments must be literals: {text!r}") from exc


def shard_listen(listen: str, shard: int) -> str:
    parts = urlsplit(listen if "://" in listen else f"tcp://{listen}")
    port = parts.port or 0
    host = parts.hostname or "0.0.0.0"
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host}:{port + shard if port else 0}"


def one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """A bad argument is one line on stderr (what and why) and exit status 2."""
    def error(message: str) -> NoReturn:
        parser.exit(2, f"{parser.prog}: error: {message}\n")
    parser.error = error  # type: ignore[method-assign]
    return parser


def check(args: argparse.Namespace) -> None:
    """What argparse cannot check alone; UsageError naming the argument."""
    if args.shard is not None and args.shard >= args.shards:
        raise UsageError(f"--shard {args.shard} outside 0..{args.shards - 1} "
                         f"(--shards {args.shards})")
    port = urlsplit(args.listen if "://" in args.listen else f"tcp://{args.listen}").port
    if port and port + args.shards - 1 > 65535:
        raise UsageError(f"--listen port {port} + {args.shards} shards runs past 65535")
    # getLevelName maps a known name to its number (getLevelNamesMapping is 3.11+)
    if not isinstance(logging.getLevelName(args.log_level.upper()), int):
        raise UsageError(f"--log-level {args.log_level!r}: not a logging level")
    try:
        resolve_device(args.device)
    except UsageError as exc:
        raise UsageError(f"--device: {exc}") from exc


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        check(args)
        logging.getLogger("tensorx").setLevel(args.log_level.upper())  # a service logs
        _eventloop.run(serve(args), args.loop)
    except UsageError as exc:
        print(f"tensorx ps: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except TensorxError as exc:
        logger.error("%s: %s", type(exc).__name__, exc)
        return 2
    return 0


async def serve(args: argparse.Namespace) -> None:
    from tensorx.ps import ParameterServer  # noqa: PLC0415 (imports torch: when the subcommand runs, not on --help)

    shards = range(args.shards) if args.shard is None else [args.shard]
    optimizer = parse_optimizer(args.optimizer)
    lr_scheduler = parse_lr_scheduler(args.lr_scheduler)
    servers = [ParameterServer(
        shard_listen(args.listen, s), num_workers=args.workers, mode=args.mode,
        staleness=args.staleness, optimizer=optimizer, shard=s, num_shards=args.shards,
        lr_scheduler=lr_scheduler,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        checkpoint_keep=args.checkpoint_keep, resume_optimizer=args.resume_optimizer,
        share_memory=args.share_memory,
        token=args.token, transport=args.transport, insecure=args.insecure,
        log_every=args.log_every or None, flat=args.flat, pipeline=args.pipeline,
        on_worker_loss=args.on_worker_loss, worker_loss_timeout=args.worker_loss_timeout,
        clip_grad_norm=args.clip_grad_norm, on_nonfinite=args.on_nonfinite,
        send_timeout=args.send_timeout, device=args.device)
        for s in shards]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _stop_all, servers, sig)
    exporter = _serve_metrics(servers, args.metrics_port, args.metrics_addr)
    try:
        await _start_and_serve(servers, args.rendezvous,
                               "workers_done" if args.exit_when_done else None, args.listen)
    finally:
        if exporter is not None:
            await asyncio.to_thread(stop_prometheus, exporter)  # bounded: 5 s at most
    logger.info("stopped cleanly")


async def _start_and_serve(servers: Sequence[Any], rendezvous: bool,
                           until: str | None, listen: str) -> None:
    for server in servers:
        await server.start()
        # the address in the scheme asked for (workers may use either); the data transport
        # the node chose is named beside it (and logged by the node)
        scheme, _, rest = server.address.partition("://")
        asked = listen.partition("://")[0] if "://" in listen else "tcp"
        print(f"tensorx ps shard {server.shard}/{server.num_shards} (data over {scheme}) "
              f"listening on {asked}://{rest}", flush=True)
    loop = asyncio.get_running_loop()
    store = await loop.run_in_executor(None, _publish, servers) if rendezvous else None
    await asyncio.gather(*(server.serve(until=until) for server in servers))
    del store  # the store may be hosted here (rank 0 without an agent): keep it up till now


def _serve_metrics(servers: Sequence[Any], port: int | None, addr: str) -> Any:
    """One Prometheus exporter for every shard of this process (None: off)."""
    if port is None:
        return None
    exporter = serve_prometheus(port, *(s.node for s in servers), servers=servers, addr=addr)
    print(f"tensorx ps metrics on http://{addr}:{exporter.server_port}/metrics", flush=True)
    return exporter


def _stop_all(servers: Sequence[Any], sig: signal.Signals) -> None:
    logger.info("%s: checkpointing and stopping", sig.name)
    for server in servers:
        server.stop()


def _publish(servers: Sequence[Any]) -> Any:
    from tensorx.ps import launcher_store  # noqa: PLC0415 (imports torch: when the subcommand runs, not on --help)

    store = launcher_store()
    for server in servers:
        server.publish(store)
    logger.info("published %d address(es) in the launcher's store", len(servers))
    return store


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tensorx ps", description=__doc__)
    _arguments(one_line_errors(parser))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
