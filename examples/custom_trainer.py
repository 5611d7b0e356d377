"""A plain PyTorch training loop, moved onto a parameter server by adding two lines.

The loop below is ordinary PyTorch; the two lines marked ``# tensorx`` are the whole change:
the import, and a ``tx.RemoteOptimizer`` where ``torch.optim.SGD`` used to be (the optimizer
itself now runs on the server, configured with ``--optimizer`` there).

    python examples/custom_trainer.py                     # starts its own `tensorx ps`
    python examples/custom_trainer.py --ps tcp://HOST:7000 --rank 1 --workers 2
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

import tensorx as tx  # tensorx


def train(ps: str, rank: int, workers: int, transport: str, epochs: int) -> float:
    torch.manual_seed(0)
    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x / 16.0, y, test_size=0.2, random_state=0,
                                              stratify=y)
    as_t = lambda a, t: torch.tensor(a, dtype=t)  # noqa: E731
    train_set = TensorDataset(as_t(x_tr, torch.float32), as_t(y_tr, torch.long))
    loader = DataLoader(train_set, batch_size=32, shuffle=True)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    loss_fn = nn.CrossEntropyLoss()

    # optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    optimizer = tx.RemoteOptimizer(model, ps=ps, rank=rank, num_workers=workers,  # tensorx
                                   transport=transport)

    for _ in tqdm(range(epochs), desc="epochs", file=sys.stdout):
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            optimizer.step()

    with torch.no_grad():
        pred = model(as_t(x_te, torch.float32)).argmax(1)
    return float((pred == as_t(y_te, torch.long)).float().mean())


def start_server(transport: str) -> tuple[subprocess.Popen[str], str]:
    """``tensorx ps`` in a child process; its first stdout line names the address."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorx", "ps", "--listen", "tcp://127.0.0.1:0",
         "--workers", "1", "--optimizer", "sgd:lr=0.05,momentum=0.9",
         "--transport", transport, "--log-level", "WARNING"],
        stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise SystemExit(f"tensorx ps did not start: {line!r}")
    return proc, line.split()[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ps", default=None, help="server address (default: start one here)")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--transport", choices=("auto", "tcp", "ucx"), default="auto")
    p.add_argument("--epochs", type=int, default=12)
    args = p.parse_args()
    server = None
    if args.ps is None:
        server, args.ps = start_server(args.transport)
    t0 = time.perf_counter()
    try:
        accuracy = train(args.ps, args.rank, args.workers, args.transport, args.epochs)
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
    print(f"trained in {time.perf_counter() - t0:.1f} s")
    print(f"accuracy {accuracy:.4f}")


if __name__ == "__main__":
    main()
