"""Sans-IO core of a pipeline: block hashing, per-stage block pool and admission, planner.

Nothing here imports torch, threads or sockets; the runtime and the simulator drive the
same objects. Entry points of the cache and admission side:

- ``hashing``: ``ExtraKeys``, ``BlockHash``, ``hash_block_tokens``.
- ``block_pool.BlockPool`` (with ``prefix_index.PrefixIndex`` and ``kv_events``).
- ``request.RequestSpec``: a prompt as the leader sends it to the stages once.
- ``coordinator.AdmissionCoordinator`` (leader) and ``stage_admission.StageAdmission``
  (every stage) exchange ``admission_messages``; ``round_driver.run_round`` runs one round
  in-process. At execution time a stage calls ``StageAdmission.materialise`` /
  ``complete`` / ``abort``.
- ``policy.Policy``: the scheduling knobs; ``wave_scheduler.WaveScheduler``: the leader's
  per-request progress, waves from ``planner.WavePlanner``, completion and abort.
- ``request``: the one prefix-reuse rule every engine and the router apply.
"""
