"""A bundle's launchers: plan.json, train.sh (the torchrun command `onboard train` runs, on one node or several)
and train.slurm."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from runtime.plan import Plan

FACTORY = "onboard.train:build_model"

DEVICES_PER_NODE = 8  # what train.slurm asks of each node when the plan's world divides into such nodes


def write_launcher(directory: Path, plan: Plan | None = None) -> None:
    """plan.json (one process by default), train.sh (the torchrun command for it, on one node or several) and
    train.slurm (the same on a Slurm cluster) into a bundle."""
    from onboard.adapt.codegen import environment

    plan = plan or Plan()
    (directory / "plan.json").write_text(plan.to_json())
    world = plan.world_size
    # train.sh passes its own arguments on to runtime.train, whose flags are TrainJob's fields
    cmd = ["torchrun", "--standalone", f"--nproc-per-node={world}", "-m", "runtime.train", "--model", FACTORY,
           "--model-kwargs", json.dumps({"bundle": ".", "layers": None, "width": 1}, sort_keys=True),
           "--plan", "plan.json", "--steps", "10", "--checkpoint-dir", "checkpoints", "--runlog", "runs/train.jsonl"]
    nodes = world // DEVICES_PER_NODE if world % DEVICES_PER_NODE == 0 and world > DEVICES_PER_NODE else 1
    program = cmd[cmd.index("-m"):]  # what follows torchrun's own options
    for name, text in (("train.sh", environment().get_template("train.sh.j2").render(
                            world=world, command=" ".join(shlex.quote(c) for c in cmd),
                            program=" ".join(shlex.quote(c) for c in program))),
                       ("train.slurm", environment().get_template("train.slurm.j2").render(
                            world=world, nodes=nodes, per_node=world // nodes))):
        (directory / name).write_text(text)
        (directory / name).chmod(0o755)
