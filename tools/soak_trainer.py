"""The trainer side of the soak's dead-trainer fault (tools/soak_control.py drives it): group rank 0
of a torch.distributed weight update group (gloo), broadcasting the checkpoint's own tensors.

    python tools/soak_trainer.py --model DIR --port P --group NAME --tensors K

It prints, one JSON line each: what it will broadcast ({"names", "dtypes", "shapes"}: the body of
/update_weights_from_distributed), {"joined": true} once the server joined the group, and
{"sent": K} after its first K broadcasts (every tensor when K < 0). Then it waits for a line on
stdin before it exits, so that a driver decides when it goes: by that line (a trainer that finished)
or by SIGKILL (a trainer that died mid-broadcast).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TOOLS_DIR))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, required=True, help="the group's rendezvous port (this process listens)")
    p.add_argument("--group", required=True)
    p.add_argument("--tensors", type=int, default=-1, help="broadcast this many, then wait (<0: all of them)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds the rendezvous and each broadcast may take")
    args = p.parse_args(argv)

    import torch.distributed as dist

    from fastdeploy_r3.distributed.weight_update_group import destroy_weight_update_group, init_weight_update_group
    from fastdeploy_r3.model_executor.model_loader import iter_safetensors, safetensors_files

    items = list(iter_safetensors(safetensors_files(args.model)))
    print(json.dumps({"names": [n for n, _ in items],
                      "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in items],
                      "shapes": [list(t.shape) for _, t in items]}), flush=True)
    group = init_weight_update_group("127.0.0.1", args.port, 0, 2, args.group, "gloo", timeout_s=args.timeout)
    print(json.dumps({"joined": True}), flush=True)
    count = len(items) if args.tensors < 0 else min(args.tensors, len(items))
    for _, tensor in items[:count]:
        dist.broadcast(tensor, src=0, group=group)
    print(json.dumps({"sent": count}), flush=True)
    sys.stdin.readline()  # the driver's go-ahead to leave (or its SIGKILL)
    destroy_weight_update_group(group)
    return 0


if __name__ == "__main__":
    sys.exit(main())
