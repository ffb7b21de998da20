"""Multi-device execution: mesh, launcher, TP/EP plans, Ulysses and ring SP, CFG and DP.

Submodules (import them directly; this package imports nothing at import
time, so ``omni.parallel.styles`` stays usable from model code):

    styles    the plan vocabulary (pure data) used by models/<m>/parallel.py
    mesh      degrees, rank coordinates, process groups, expert layout
    comm      collectives of one mesh axis (platform communicator or torch.distributed)
    launch    one process per rank, torchrun entry, clean teardown
    tp        applies a plan: module swaps, comm hooks, sharded checkpoint reads
    ep        expert dispatch/combine (token selection or all-to-all)
    ulysses   all-to-all heads <-> sequence attention
    ring      ring attention with K/V rotation and log-sum-exp merge
    sequence  splits one packed forward over the sequence-parallel ranks
    cfg       guidance rows on rank groups, predictions exchanged every step
    runtime   the per-worker object passed to the pipeline builder
    driver    lock-step execution of a multi-rank replica under one scheduler
    dp        the router that spreads requests over independent replicas
"""
