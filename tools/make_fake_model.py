"""Write a deterministic random MoE checkpoint in Hugging Face format, or a real model's shape.

    python tools/make_fake_model.py --arch qwen3_moe --out /tmp/tiny-qwen3 [--preset tiny|small] [--seed 0]
                                    [--dtype float32|bfloat16] [--fp8]   (--fp8: a block-wise fp8 checkpoint)
    python tools/make_fake_model.py --preset qwen3-30b-a3b --out /tmp/qwen3-30b [--layers 8]

Real-shape presets (tools/model_presets.py) write config.json and a tokenizer only, for load_format=dummy.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fake_model import ARCHS, PRESETS, make_fake_model
from model_presets import MODEL_PRESETS, write_preset


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=ARCHS, help="needed for the tiny/small presets")
    p.add_argument("--out", required=True, help="output directory (created if missing)")
    p.add_argument("--preset", default="tiny", choices=PRESETS + tuple(MODEL_PRESETS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="dtype of the saved weights")
    p.add_argument("--fp8", action="store_true", help="save dense linears and experts as block-wise fp8 "
                   "(float8_e4m3fn + weight_scale_inv per 128x128 block), quantized from --dtype weights")
    p.add_argument("--layers", type=int, default=None, help="real-shape presets: cut to this many layers")
    args = p.parse_args(argv)
    if args.preset in MODEL_PRESETS:
        print(write_preset(args.preset, args.out, args.layers))
        return
    if args.arch is None:
        p.error(f"--arch is required with --preset {args.preset}")
    print(make_fake_model(args.arch, args.out, preset=args.preset, seed=args.seed, dtype=args.dtype,
                          fp8=args.fp8))


if __name__ == "__main__":
    main()
