"""The KV cache room: which blocks a request's tokens live in, across the GPU pool, the CPU tier and the
storage tier, and the process that moves blocks (with their R3 rows) between tiers.

    block_pool.py, block_hash.py, slots.py   the GPU pool, content hashes of full blocks, slot arithmetic
    prefix_cache_manager.py                  block tables, the hash chain, prefix hits (bookkeeping only)
    kv_connector.py, cpu_tier.py, storage_tier.py   the KV connector interface and its two tiers (the
                                             storage tier also loads a PD prefill server's rooms)
    block_copy.py                            the one owner of "routing rows move with their KV"
    transfer_supervisor.py                   the CTM over its life (lost, replaced, deadlines)
    routing_buffer.py, routing_cache_manager.py   R3 rows addressed by KV slot, gathered per request
    cache_transfer_manager.py, cache_transfer_client.py, transfer.py, kv_tiers.py   the CTM subprocess
                                             and its typed messages (swap out / in, storage load / put,
                                             PD load); ctm_process.py its process and task loop
    pd_receive.py                            in the CTM: a prefill server's writes into the GPU tier
    storage.py, storage_lookup.py            the stored block's codec; storage lookups off the engine loop
    shm.py                                   named shared-memory segments

It may import blobstore/, config/, r3/ (errors, layouts), worker/messages.py and lifecycle.py; never
engine/ or entrypoints/ (tests/test_layering.py).
"""
