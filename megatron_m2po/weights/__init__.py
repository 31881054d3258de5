"""Everything that takes the trainer's weights to the rollout engines (and to HF directories).

A push, top to bottom:

* ``push.py``: :class:`~.push.WeightPushController`, the engines' weight version on every rank and,
  on global rank 0, the push itself (drain generation, record the version, relaunch and refit dead
  engines); :func:`~.push.build_weight_sync` picks the transport of ``rollout.weight_sync``;
* ``stage.py``: the stage side every rank runs (:func:`~.stage.push_from_stages`): each pipeline
  stage sends or writes its own layers (:class:`~.stage.PushPlan` in, :class:`~.stage.StageResult` out);
* the transports, rank 0's half of a push, one module each behind the interface of
  ``transport.py`` (:class:`~.transport.WeightSync`, :class:`~.transport.SyncStats`):
  ``disk.py`` (safetensors shards in a shared directory, ``version_dir.py`` its layout) and
  ``distributed.py`` (a broadcast per stage to the engines, ``nccl_handshake.py`` its NCCL version
  check). The coming transports go here as modules of their own: colocated engines (CUDA IPC
  handles of the trainer's tensors) and LoRA adapters (only the adapter weights pushed);
* ``fp8.py``: block-FP8 quantisation on the way out, the FP8 base model export
  (:func:`~.fp8.export_fp8_dir`) and the CPU worker's FP8 linears;
* ``hf_export.py``: the one HF exporter: each stage's HF-named tensors (the push's input) and HF
  directories written by every stage (:func:`~.hf_export.export_hf`); ``convert.py``: ``m2po convert``;
* ``errors.py``: :class:`~.errors.WeightSyncError` and :class:`~.errors.NcclVersionMismatch`.

Layering (``tests/test_import_graph.py``): above ``actor/`` and ``rollout/`` (which never import
it), below ``rollout_service/`` and ``trainer/``. The disk push's load timeout
(``rollout/push_timeout.py``) stays in ``rollout/``: the engine fleet sizes its router's timeout
with it. Import the submodules.
"""
