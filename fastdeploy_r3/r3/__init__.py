"""The R3 room: the routed experts of a request as a payload, from the rows the workers captured to
what a trainer reads (see docs/r3_client.md).

    config.py      RoutingReplayConfig (--routing-replay-config) and the R3 shape derived from the model
    errors.py      RoutingReplayError and the no-route sentinel (numpy only: models and workers use it)
    codec.py, layouts.py   `.npy`/base64 encoding; the moe and all_layers layouts
    rollout_id.py  rollout ids and the key rules that keep stores from colliding
    stores/        where R3 goes when it is not in the response (local, Redis, Mooncake)
    delivery.py    one finished request's R3 into the response or the store, with a deadline

A trainer loads it alone, so it imports only blobstore/, errors.py and outputs.py types; never
model_executor/, cache_manager/, engine/ or entrypoints/.
"""
