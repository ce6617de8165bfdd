"""The worker's sampling: from one step's logits to the sampled ids and the logprobs that were asked for.

    sampler.py    per-request sampling state and the step's pipeline (penalties -> draw -> logprobs)
    draw.py       one id per row in a few batched ops: temperature, top-k, top-p, seeded exponential race
    penalties.py  repetition / frequency / presence penalties and the min_tokens mask
    logprobs.py   log-probabilities of sampled and prompt tokens, on the device in float32

It imports torch, the request types (sampling_params.py, logprobs.py) and worker/messages.py; never
engine/ or model_executor/.
"""
