"""Prefill/decode disaggregation (SGLang's PD protocol, driven by `sglang-router --pd-disaggregation`).

    handoff.py    the typed messages: where a request's prefill lives (bootstrap host, port, room) and
                  what P hands D once its prompt is computed (first token, weight version, prompt digest)
    bootstrap.py  P's bootstrap server (rooms, long-polled by D) and D's client of it
    te_transfer.py  the mooncake backend's transfer: P's arena registered with Mooncake Transfer Engine,
                  its outbox of published rooms, the manifest, P's bootstrap routes
    te_in_place.py  P's writes of a room's blocks into the memory D's cache transfer manager names
    te_blocks.py  the mooncake backend's blocks: P's reads from its store, D's room for its engine
    roles.py      the server flags and what each role does with a request that carries bootstrap fields

docs/pd.md explains the protocol, what travels, and the R3 invariant across the boundary.
"""
