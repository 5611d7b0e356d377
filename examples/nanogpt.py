"""nanoGPT's ``train.py`` loop on a parameter server: a port of karpathy/nanoGPT (MIT).

What carries over as it is: the GPT (``model.py``, small), ``configure_optimizers`` (AdamW,
weight decay for the tensors with ``dim() >= 2``, none for biases and LayerNorm weights), the
warmup + cosine learning rate set through ``param_group["lr"]`` every iteration, gradient
accumulation, gradient clipping at 1.0, evaluation, and checkpoints that hold
``optimizer.state_dict()`` and resume from it. What changes is marked ``# tensorx``:

* the optimizer is a ``tx.RemoteOptimizer``; ``configure_optimizers`` becomes the server's
  optimizer factory (it is called with ``named_params``, the model's names and tensors);
* clipping is the server's ``clip_grad_norm=``: ``clip_grad_norm_`` on a worker would clip
  that worker's gradient, not the averaged one that single-process training clips;
* the data: the Zen of Python, which ships with every Python, at character level.

Each rank trains on its slice of one global batch, so two sync workers train exactly as one
process on the whole batch (tests/e2e/test_nanogpt.py checks it, through a resume)::

    python examples/nanogpt.py                  # a server here + 2 worker processes
    python examples/nanogpt.py --resume         # continue from out-nanogpt/ckpt.pt
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import math
import multiprocessing
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import tensorx as tx  # tensorx


# -- the model: nanoGPT's model.py, abridged ------------------------------------------------
@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True


class LayerNorm(nn.Module):
    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training
                                           else 0.0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, seed: int = 1337) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(config.vocab_size, config.n_embd),
            "wpe": nn.Embedding(config.block_size, config.n_embd),
            "h": nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            "ln_f": LayerNorm(config.n_embd, bias=config.bias),
        })
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        # initialised from a generator of its own: every rank builds the same model (even
        # ranks that are threads of one process, which share torch's global generator)
        gen = torch.Generator().manual_seed(seed)
        self.apply(lambda module: self._init_weights(module, gen))
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer),
                                generator=gen)

    def _init_weights(self, module: nn.Module, gen: torch.Generator) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02, generator=gen)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), dtype=torch.long)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def configure_optimizers(named_params: Any, weight_decay: float, learning_rate: float,
                         betas: tuple[float, float]) -> torch.optim.Optimizer:
    """nanoGPT's GPT.configure_optimizers: decay the 2D tensors (matmuls, embeddings)."""
    params = [(n, p) for n, p in named_params if p.requires_grad]
    optim_groups = [
        {"params": [p for _, p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for _, p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas)


# -- train.py -------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    max_iters: int = 40
    eval_interval: int = 10     # evaluate and checkpoint every eval_interval iterations
    eval_iters: int = 4
    batch_size: int = 4         # per worker; the global batch is batch_size * world
    world: int = 2              # the workers whose slices make one global batch
    gradient_accumulation_steps: int = 2
    learning_rate: float = 3e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    warmup_iters: int = 5
    lr_decay_iters: int = 40
    min_lr: float = 3e-4
    seed: int = 1337


def zen() -> str:
    """The Zen of Python, from the ``this`` module of the standard library."""
    import codecs

    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


class Data:
    """Character-level train/val split of a text, like nanoGPT's shakespeare_char."""

    def __init__(self, text: str, block_size: int) -> None:
        self.chars = sorted(set(text))
        ids = torch.tensor([self.chars.index(c) for c in text], dtype=torch.long)
        n = int(0.9 * len(ids))
        self.split = {"train": ids[:n], "val": ids[n:]}
        self.block_size = block_size

    def get_batch(self, split: str, cfg: TrainConfig, it: int, micro: int,
                  rank: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch ``micro`` of iteration ``it``: one global batch drawn from a seed of
        its own; rank ``r`` takes slice ``r`` of it, None (one process) all of it."""
        data = self.split[split]
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + it * 1009 + micro)
        ix = torch.randint(len(data) - self.block_size, (cfg.batch_size * cfg.world,),
                           generator=gen)
        if rank is not None:
            ix = ix[rank * cfg.batch_size:(rank + 1) * cfg.batch_size]
        x = torch.stack([data[i:i + self.block_size] for i in ix.tolist()])
        y = torch.stack([data[i + 1:i + 1 + self.block_size] for i in ix.tolist()])
        return x, y


def get_lr(it: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay down to min_lr (nanoGPT's get_lr)."""
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it > cfg.lr_decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / (cfg.lr_decay_iters - cfg.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return cfg.min_lr + coeff * (cfg.learning_rate - cfg.min_lr)


@torch.no_grad()
def estimate_loss(model: GPT, data: Data, cfg: TrainConfig, it: int) -> dict[str, float]:
    model.eval()
    out = {split: sum(float(model(*data.get_batch(split, cfg, it, -1 - k, None)))
                      for k in range(cfg.eval_iters)) / cfg.eval_iters
           for split in ("train", "val")}
    model.train()
    return out


MakeOptimizer = Callable[[GPT], torch.optim.Optimizer]


def saved(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` as ``torch.load`` reads it back from the file nanoGPT writes (the
    model's tensors keep training after this: a checkpoint must be a copy)."""
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


def train(cfg: TrainConfig, model_cfg: GPTConfig, make_optimizer: MakeOptimizer,
          rank: int | None = None, resume: dict[str, Any] | None = None,
          clip_here: bool = True, log: Callable[[str], None] | None = None
          ) -> tuple[GPT, list[dict[str, Any]]]:
    """nanoGPT's training loop. ``rank``: this worker's slice of each global batch (None:
    the whole batch, one process). Returns the model and the checkpoints rank 0 (or the one
    process) took, each as ``torch.save`` would write it."""
    torch.manual_seed(cfg.seed)
    data = Data(zen(), model_cfg.block_size)
    model_cfg.vocab_size = len(data.chars)
    model = GPT(model_cfg, cfg.seed)
    iter_num = 0
    if resume is not None:
        model.load_state_dict(resume["model"])
        iter_num = resume["iter_num"]
    optimizer = make_optimizer(model)
    if resume is not None:
        optimizer.load_state_dict(resume["optimizer"])
    checkpoints: list[dict[str, Any]] = []
    while iter_num < cfg.max_iters:
        lr = get_lr(iter_num, cfg)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % cfg.eval_interval == 0 and iter_num > 0 and rank in (0, None):
            losses = estimate_loss(model, data, cfg, iter_num)
            if log:
                log(f"iter {iter_num}: train loss {losses['train']:.4f}, "
                    f"val loss {losses['val']:.4f}, lr {lr:.2e}")
            checkpoints.append(saved({"model": model.state_dict(),
                                      "optimizer": optimizer.state_dict(),
                                      "model_args": asdict(model_cfg), "iter_num": iter_num,
                                      "config": asdict(cfg)}))
        for micro_step in range(cfg.gradient_accumulation_steps):
            x, y = data.get_batch("train", cfg, iter_num, micro_step, rank)
            loss = model(x, y) / cfg.gradient_accumulation_steps
            loss.backward()
        if cfg.grad_clip != 0.0 and clip_here:  # tensorx: on the server (clip_grad_norm=)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
    return model, checkpoints


# -- the parameter server and the workers ---------------------------------------------------
def server_options(cfg: TrainConfig) -> dict[str, Any]:
    """The ParameterServer's optimizer, built by configure_optimizers on the server."""
    def optimizer(named_params: Any) -> torch.optim.Optimizer:  # tensorx
        return configure_optimizers(named_params, cfg.weight_decay, cfg.learning_rate,
                                    (cfg.beta1, cfg.beta2))

    clip = {"clip_grad_norm": cfg.grad_clip} if cfg.grad_clip else {}  # tensorx
    return {"mode": "sync", "optimizer": optimizer, **clip}


@contextlib.contextmanager
def serving(cfg: TrainConfig, num_workers: int, num_shards: int = 1,
            **options: Any) -> Iterator[list[str]]:
    """``num_shards`` parameter-server shards on a background event loop, for
    ``num_workers`` workers; yields their addresses."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="nanogpt-ps")
    thread.start()
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result()  # noqa: E731
    shards: list[Any] = []
    try:
        for s in range(num_shards):
            shards.append(tx.ParameterServer("tcp://127.0.0.1:0", num_workers=num_workers,
                                             shard=s, num_shards=num_shards, log_every=None,
                                             **server_options(cfg), **options))
            run(shards[-1].start())
        yield [ps.address for ps in shards]
    finally:
        for ps in shards:
            run(ps.aclose())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def remote(ps: list[str], rank: int, world: int, **options: Any) -> MakeOptimizer:
    """What replaces ``model.configure_optimizers(...)`` on a worker."""
    return lambda model: tx.RemoteOptimizer(model, ps, rank, world, **options)  # tensorx


def worker_main(ps: list[str], rank: int, cfg: TrainConfig, model_cfg: GPTConfig,
                out: str, resume: bool, options: dict[str, Any]) -> None:
    ckpt = torch.load(Path(out) / "ckpt.pt", weights_only=True) if resume else None
    if ckpt is not None and rank == 0:
        print(f"resumed from iter {ckpt['iter_num']}")
    optimizers: list[Any] = []

    def make(model: GPT) -> torch.optim.Optimizer:
        optimizers.append(remote(ps, rank, cfg.world, **options)(model))
        return optimizers[-1]  # type: ignore[no-any-return]

    try:
        model, checkpoints = train(cfg, model_cfg, make, rank, ckpt, clip_here=False,
                                   log=print if rank == 0 else None)
    finally:
        for opt in optimizers:
            opt.close()
    if rank == 0:
        for checkpoint in checkpoints:
            torch.save(checkpoint, Path(out) / "ckpt.pt")
        data = Data(zen(), model_cfg.block_size)
        print(f"final val loss {estimate_loss(model, data, cfg, cfg.max_iters)['val']:.4f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-iters", type=int, default=40)
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument("--transport", choices=("auto", "tcp", "ucx"), default="auto")
    p.add_argument("--no-share-memory", action="store_true")
    p.add_argument("--out", default="out-nanogpt")
    p.add_argument("--resume", action="store_true", help="resume from OUT/ckpt.pt")
    args = p.parse_args()
    cfg = TrainConfig(max_iters=args.max_iters, lr_decay_iters=args.max_iters,
                      eval_interval=args.eval_interval, world=args.workers)
    Path(args.out).mkdir(exist_ok=True)
    share = not args.no_share_memory
    options = {"transport": args.transport, "share_memory": share}
    ctx = multiprocessing.get_context("spawn")
    with serving(cfg, args.workers, **options) as ps:
        procs = [ctx.Process(target=worker_main, args=(ps, r, cfg, GPTConfig(), args.out,
                                                       args.resume, options))
                 for r in range(args.workers)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
    if any(proc.exitcode for proc in procs):
        raise SystemExit("a worker failed")


if __name__ == "__main__":
    main()
