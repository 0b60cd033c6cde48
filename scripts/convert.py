"""Convert an HF DeepSeek checkpoint directory (AWQ or not) into mla_jax's converted format (orbax + manifest).

  python scripts/convert.py SRC DST [--force]
  python scripts/convert.py SRC DST --awq-group-size 128 [--awq-exclude kv_b_proj ...]   # quantize first

The output loads directly with `mla_jax.load_model(DST)` / `mla_jax.LLM(DST)`; see
mla_jax/checkpoint/converted.py for the format. DST is written to a temporary sibling directory and renamed at
the end; an existing DST is only replaced with --force. Exit status 2 on bad input (a missing or corrupt source
file, an existing DST): one line naming the file and the fix; --verbose adds the traceback and INFO logging.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from mla_jax.checkpoint.converted import convert_checkpoint
from mla_jax.checkpoint.files import resolve_model_dir
from mla_jax.cli import USER_ERRORS, configure_logging, report_error
from mla_jax.quant.pack import quantize_checkpoint


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="HF checkpoint directory -> mla_jax converted directory (orbax)")
    ap.add_argument("src", help="HF model directory: config.json + *.safetensors (AWQ or bf16/fp16/fp32)")
    ap.add_argument("dst", help="output directory (must not exist unless --force)")
    ap.add_argument("--force", action="store_true", help="replace DST if it exists")
    ap.add_argument("--awq-group-size", type=int, default=None,
                    help="first quantize an unquantized SRC to AWQ int4 with this group size (RTN, AutoAWQ packing)")
    ap.add_argument("--awq-exclude", nargs="*", default=[],
                    help="modules_to_not_convert for --awq-group-size (substring match on HF module names)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--verbose", action="store_true", help="INFO logging; tracebacks with errors")
    args = ap.parse_args(argv)
    configure_logging(args.verbose)
    try:
        return convert(args)
    except USER_ERRORS as e:
        return report_error(e, args.verbose)


def convert(args) -> int:
    """main's work; bad input raises (main reports it on one line)."""
    if os.path.exists(args.dst) and not args.force:
        raise FileExistsError(f"{args.dst} already exists; pass --force to replace it")
    t0 = time.perf_counter()
    src = resolve_model_dir(args.src)        # a path, or the name of an embedded model
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(args.dst)) or ".") as tmp:
        if args.awq_group_size:
            quantized = os.path.join(tmp, "awq")
            quantize_checkpoint(src, quantized, group_size=args.awq_group_size,
                                modules_to_not_convert=args.awq_exclude)
            src = quantized
        manifest = convert_checkpoint(src, args.dst, force=args.force, progress=not args.quiet)
    n = len(manifest["tensors"])
    print(f"wrote {args.dst}: {n} tensors, storage dtype {manifest['storage_dtype']}, "
          f"{'AWQ int4' if manifest['quantization'] else 'unquantized'}, {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
