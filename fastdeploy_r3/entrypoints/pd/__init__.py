"""Prefill/decode disaggregation (SGLang's PD protocol, driven by `sglang-router --pd-disaggregation`).

    handoff.py    the typed messages: where a request's prefill lives (bootstrap host, port, room) and
                  what P hands D once its prompt is computed (first token, weight version, prompt digest)
    bootstrap.py  P's bootstrap server (rooms, long-polled by D) and D's client of it
    te_transfer.py  the mooncake backend's transfer: arenas registered with Mooncake Transfer Engine, the
                  manifest / target / completion messages, P's bootstrap routes and D's pull
    te_blocks.py  the mooncake backend's blocks: keys, P's reads from its store, D's stores into its own
    roles.py      the server flags and what each role does with a request that carries bootstrap fields

docs/pd.md explains the protocol, what travels, and the R3 invariant across the boundary.
"""
