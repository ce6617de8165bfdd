"""Write a deterministic random MoE checkpoint in Hugging Face format.

    python tools/make_fake_model.py --arch qwen3_moe --out /tmp/tiny-qwen3 [--preset tiny|small] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fake_model import ARCHS, PRESETS, make_fake_model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", required=True, choices=ARCHS)
    p.add_argument("--out", required=True, help="output directory (created if missing)")
    p.add_argument("--preset", default="tiny", choices=PRESETS)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(make_fake_model(args.arch, args.out, preset=args.preset, seed=args.seed))


if __name__ == "__main__":
    main()
