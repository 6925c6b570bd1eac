"""`python -m ext`: build the extension ahead of time (if needed) and say what was built.

Example:
    $ LINEAR_LAB_CUDA=1 python -m ext     # build with CUDA kernels for a GPU machine
"""
import argparse

import torch

import ext


def _fma_peak_text(num_threads: int) -> str:
    peak_gflops = torch.ops.ext.fma_peak_gflops(num_threads)
    if peak_gflops == 0:
        return "n/a (no vector FMA on this CPU)"
    return f"{peak_gflops:.0f} GFLOP/s float32 on {num_threads} threads (measured now)"


def _block_sizes_text() -> str:
    """The active path's float32 blocking, as the kernels use it (ext.cpu_block_sizes)."""
    b = torch.ops.ext.cpu_block_sizes(torch.ops.ext.cpu_path(), "float32")
    tall = "" if b["tall_mr"] == b["wide_mr"] else f", {b['tall_mr']}x{b['tall_nr']} for {b['tall_mr']} rows"
    return (f"float32 tile {b['wide_mr']}x{b['wide_nr']} ({b['many_rows_mr']}x{b['many_rows_nr']} from "
            f"{b['many_rows_min_rows']} rows{tall}, {b['one_vector_mr']}x{b['lanes']} for a last panel of one "
            f"vector), KC {b['kc']} (one block up to {b['max_single_k_block']}), "
            f"MC {b['mc']}, NC {b['nc']}, for L1d {b['l1d_bytes'] // 1024} KiB and L2 {b['l2_bytes'] // 1024} KiB "
            f"per core; the forward as Yᵀ = W·Xᵀ from {b['transposed_min_rows']} rows where "
            f"in·(out − batch) > {b['transposed_c_cost']}·batch·out; up to K = {b['max_shallow_depth']}, "
            f"operands read in place, rows in panels of {b['shallow_mr']}x{b['shallow_nr']} tiles"
            f"{' (two 512-bit FMAs a cycle, measured)' if b['fmas_per_cycle'] == 2 else ''}")


def describe_build(manifest: dict) -> str:
    """The build's facts, one per line: versions, CPU path and peak, CUDA kernels, location."""
    kernels = manifest["kernels"]
    if not manifest["cuda"]["enabled"]:
        kernels += " (no CUDA kernels; LINEAR_LAB_CUDA=1 python -m ext builds them in)"
    rows = [
        ("torch", manifest["torch"]),
        ("compiler", manifest["compiler"]),
        ("C++ flags", " ".join(manifest["cxx_flags"])),
        ("CPU code path", torch.ops.ext.cpu_path()),
        ("CPU blocking", _block_sizes_text()),
        ("CPU threads", str(torch.get_num_threads())),
        ("FMA peak", _fma_peak_text(torch.get_num_threads())),
        ("kernels", kernels),
        ("built at", manifest["built_at"]),
        ("build dir", manifest["build_dir"]),
    ]
    return "\n".join(f"{name + ':':<15} {value}" for name, value in rows)


if __name__ == "__main__":  # no options: --help says what the command does, and anything else is refused
    argparse.ArgumentParser(prog="python -m ext", description=__doc__.split("\n")[0]).parse_args()
    print("linear-lab extension")
    print(describe_build(ext.build_manifest))
