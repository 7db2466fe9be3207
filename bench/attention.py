"""A fused attention's backward three ways (issue 37): the closed form, which
materialises the attention weights and their gradient (two score matrices), against
PyTorch's fused kernel's backward, which holds no score matrix, from what the forward
kernel saved (its output and log-sum-exp per query: ``agents.kernels.
attention_grad_from_saved``, as autograd runs it after eager PyTorch's forward and as the
executor runs it on a CPU), and with ``scaled_dot_product_attention`` run again under
autograd first (``attention_grad_by_pytorch``: where nothing was saved, as on CUDA). The
executor takes PyTorch's wherever the mask wants no gradient
(``remat.ops.pytorch_attention_backward``; column "executor takes").

Operands of ``--heads`` heads of ``--features`` features at each sequence length, the
batch sized to ``--tokens`` positions in all; unmasked, and with a constant padding mask
(batch x 1 x 1 x keys, no gradient wanted, as a BERT-style padding mask). Time: the median
of ``--repeats`` calls of each, alternating, on ``--threads`` threads; memory: the growth
of the peak resident set over one call in a fresh process (the inputs and upstream
gradient allocated before), in MiB.

Prints a markdown table and appends rows to ``bench/results/attention.csv``.

    .venv/bin/python bench/attention.py [--lengths 17,64,128,256,384,512,1024]
        [--heads 12] [--features 64] [--tokens 4096] [--threads 2] [--repeats 5]
        [--run LABEL]
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from results import Writer, add_run_argument

from agents import kernels
from agents.kernels import Grads, OpSpec, VjpCall
from remat.onnx_fusion import ATTENTION, FUSED_DOMAIN
from remat.ops import pytorch_attention_backward

WAYS: dict[str, Callable[[VjpCall], Grads | None]] = {
    "closed form": kernels.attention_grad_closed_form,
    "from saved": kernels.attention_grad_from_saved,
    "forward again": kernels.attention_grad_by_pytorch,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="17,64,128,256,384,512,1024")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    add_run_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = Writer("attention", args.run)
    print(
        "| positions | batch | mask | closed form ms | from saved ms | forward again ms "
        "| closed / from saved | closed form MiB | from saved MiB | forward again MiB "
        "| executor takes |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    # Each measurement of memory in a fresh process forked from a small server: a process
    # starts with its parent's peak as its own.
    forkserver = multiprocessing.get_context("forkserver")
    with forkserver.Pool(1, maxtasksperchild=1) as pool:
        _measure_all(args, pool, out)


def _measure_all(args: argparse.Namespace, pool: Any, out: Writer) -> None:
    for length in (int(n) for n in args.lengths.split(",")):
        batch = max(args.tokens // length, 1)
        shape = (batch, args.heads, length, args.features)
        for masked in (False, True):
            call = _call(shape, masked)
            times = _times(call, args.repeats)
            mib = {
                way: pool.apply(_peak_growth_mib, (shape, masked, way, args.threads))
                for way in WAYS
            }
            shapes = [tuple(a.shape) for a in call.args]
            takes = "pytorch" if pytorch_attention_backward(shapes, False) else "closed form"
            row: dict[str, Any] = {
                "model": "attention",
                "devices": f"cpu0:threads={args.threads}",
                "positions": length,
                "batch": batch,
                "heads": args.heads,
                "features": args.features,
                "mask": "padding" if masked else "none",
                "closed_ms": times["closed form"],
                "saved_ms": times["from saved"],
                "pytorch_ms": times["forward again"],
                "closed_mib": mib["closed form"],
                "saved_mib": mib["from saved"],
                "pytorch_mib": mib["forward again"],
                "takes": takes,
            }
            out.add(row)
            print(
                f"| {length} | {batch} | {row['mask']} | {row['closed_ms']:.2f} "
                f"| {row['saved_ms']:.2f} | {row['pytorch_ms']:.2f} "
                f"| {row['closed_ms'] / row['saved_ms']:.2f} | {row['closed_mib']:.1f} "
                f"| {row['saved_mib']:.1f} | {row['pytorch_mib']:.1f} | {takes} |",
                flush=True,
            )


def _call(shape: tuple[int, int, int, int], masked: bool) -> VjpCall:
    """A fused attention's backward call on seeded float32 operands: queries, transposed
    keys, values (and a padding mask of zeros and -inf, its last quarter masked), with the
    output and what the forward kernel saved beside it (``kernels.forward_and_saved``)."""
    generator = torch.Generator().manual_seed(0)
    batch, heads, length, features = shape
    shapes = [shape, (batch, heads, features, length), shape]
    args = [torch.randn(s, generator=generator) for s in shapes]
    if masked:
        mask = torch.zeros(batch, 1, 1, length)
        mask[..., length - length // 4 :] = float("-inf")
        args.append(mask)
    spec = OpSpec(
        ATTENTION,
        "attention",
        domain=FUSED_DOMAIN,
        opset=17,
        attrs={"scale": features**-0.5},
        inputs=tuple(f"in{i}" for i in range(len(args))),
        outputs=("out",),
    )
    output, saved = kernels.forward_and_saved(spec, args)
    if saved is None:
        raise SystemExit("PyTorch's fused CPU kernel does not take these operands")
    grads = [torch.randn(shape, generator=generator)]
    return VjpCall(spec, args, output, grads, [True, True, True, False][: len(args)], saved)


def _times(call: VjpCall, repeats: int) -> dict[str, float]:
    """Each way's median milliseconds over ``repeats`` calls, the ways alternating."""
    runs: dict[str, list[float]] = {way: [] for way in WAYS}
    for way in WAYS.values():
        if way(call) is None:
            raise SystemExit("PyTorch has no fused kernel for these operands")
    for _ in range(repeats):
        for name, way in WAYS.items():
            start = time.perf_counter()
            way(call)
            runs[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(ms) for name, ms in runs.items()}


def _peak_growth_mib(
    shape: tuple[int, int, int, int], masked: bool, way: str, threads: int
) -> float:
    """The growth of this process's peak resident set over one call of ``way``, after a
    call on small operands has loaded its kernels and the operands are allocated."""
    torch.set_num_threads(threads)
    WAYS[way](_call((1, 1, 8, 4), masked))
    call = _call(shape, masked)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    WAYS[way](call)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024


if __name__ == "__main__":
    main()
