"""The model room: MoE models in torch with the kernels they run, built from a ModelConfig.

    models/        Qwen3-MoE, Mixtral, GLM-4.5 decoder stacks (base.py) and the architecture registry
    layers/        attention, tensor-parallel linear layers, the MoE block (routers, stacked experts)
    ops/           Triton kernels (paged attention, fused MoE, RMSNorm, rotary, routing capture)
    quantization/  the method a layer's weights go through (unquantized today; FP8 plugs in there)
    model_loader.py, forward_context.py   build + load a model; what one forward pass needs besides inputs
    batch_invariant.py   deterministic mode: fixed-tile GEMMs and attention, switched on a built model

Right after top-k every MoE layer reports its logical expert ids to the forward context's routing
capture (R3). It may import config/, distributed/ and r3/errors; never cache_manager/ or engine/.
"""
