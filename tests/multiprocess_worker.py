"""One process of a multi-process (multi-"host") run on CPU, for tests/test_train_multiprocess.py.
Not a test module itself.

    python tests/multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_JSON

Each process owns 2 forced host devices (MODE=data: data-parallel training) or 4 (MODE=fsdp: a
decoder sharded ZeRO-3 style over all 8 devices: a forward and one train step); processes talk
through jax.distributed (gloo CPU collectives), exactly as separate hosts would after
``jax.distributed.initialize``.
"""

import json
import os
import sys

MODE = os.environ.get("MODE", "data")
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={4 if MODE == 'fsdp' else 2}"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def fsdp(pid: int, out: str) -> None:
    """A decoder sharded over both processes' 8 devices: logits of a forward and one train step."""
    import numpy as np
    from jax.experimental import multihost_utils
    from test_train_multiprocess import FSDP_OPTIMIZER, fsdp_batch, fsdp_loss, fsdp_model

    from jsteer import sharding
    from jsteer.backbones.decoder_params import logical_axes
    from jsteer.train import OptimizerConfig, Trainer
    from jsteer.train import step as step_lib

    module, params = fsdp_model()
    mesh = sharding.make_mesh(fsdp=8)
    placed = sharding.shard(params, logical_axes(params), mesh, "fsdp")
    ids = fsdp_batch()[pid * 4 : (pid + 1) * 4]  # this process's rows of the global batch
    batch = step_lib.global_batch({"ids": ids}, mesh)
    logits = jax.jit(lambda p, i: module.apply({"params": p}, i).logits)(placed, batch["ids"])
    trainer = Trainer(
        fsdp_loss(module),
        params,
        OptimizerConfig(**FSDP_OPTIMIZER),
        mesh=mesh,
        rules="fsdp",
        axes="auto",
        progress=False,
    )
    loss = float(trainer.train_step({"ids": ids}, 1)["loss"])
    gathered = multihost_utils.process_allgather(trainer.params, tiled=True)
    with open(out, "w") as f:
        json.dump(
            {
                "process": pid,
                "devices": len(jax.devices()),
                "loss": loss,
                "logits": np.asarray(multihost_utils.process_allgather(logits, tiled=True)).tolist(),
                "params": {
                    "/".join(str(getattr(k, "key", k)) for k in path): np.asarray(x).tolist()
                    for path, x in jax.tree_util.tree_flatten_with_path(gathered)[0]
                },
            },
            f,
        )


def main() -> None:
    pid, nproc, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    jax.distributed.initialize(
        coordinator_address=f"localhost:{port}", num_processes=nproc, process_id=pid, initialization_timeout=120
    )
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if MODE == "fsdp":
        fsdp(pid, out)
        jax.distributed.shutdown()
        return
    import numpy as np
    from test_train import GROUPS, tagger_examples, tagger_loss, tagger_params

    from jsteer.data.batching import Batcher
    from jsteer.train import Trainer, data_mesh

    assert jax.process_count() == nproc and len(jax.local_devices()) == 2
    trainer = Trainer(tagger_loss, tagger_params(), GROUPS, mesh=data_mesh(jax.devices()), progress=False)
    # The batcher hands this process its rows of each global batch (process_index/count from jax).
    batches = Batcher(tagger_examples(64), 8, buckets=(32,), pad_values={"input_ids": 0, "labels": -100}, seed=3)
    losses = []
    trainer.fit(batches, int(os.environ.get("STEPS", "12")), on_step=lambda s, m: losses.append(float(m["loss"])))
    params = {
        "/".join(str(getattr(k, "key", k)) for k in path): np.asarray(jax.device_get(x)).tolist()
        for path, x in jax.tree_util.tree_flatten_with_path(trainer.params)[0]
        if x.is_fully_addressable or x.is_fully_replicated
    }
    with open(out, "w") as f:
        json.dump({"process": pid, "devices": len(jax.devices()), "losses": losses, "params": params}, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
