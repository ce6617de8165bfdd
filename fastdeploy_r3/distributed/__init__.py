"""The distributed room: process groups between ranks, and the groups a trainer joins to push weights.

    parallel_state.py       the workers' tensor-parallel group (gloo on CPU, NCCL on CUDA) and its reductions
    weight_update_group.py  a process group shared with a trainer, over which new weights are broadcast

An expert-parallel group (ranks that each hold a slice of the experts, with all-to-all dispatch of the
routed tokens) will live here beside the tensor-parallel one. This room imports torch and nothing of the
package, so that the worker (model_executor/, worker/) and the trainer-side client (client/) can both
use it without loading each other.
"""
