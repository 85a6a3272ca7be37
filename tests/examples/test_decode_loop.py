"""The main job, as CI runs it: examples/decode_loop.py's small configuration on the CPU, in a
subprocess (it spawns an offload process and a second process that loads the AOT artifact)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_decode_loop_matches_with_preemption_and_aot_reload(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "examples/decode_loop.py", "--config", "small", "--disk", str(tmp_path)]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = result.stdout
    assert result.returncode == 0, f"{out}\n{result.stderr[-4000:]}"
    assert out.splitlines()[-1] == "decode loop: tokens match", out
    # Preemption happened, through the disk tier, and every row of that run was bitwise equal.
    preempted = re.search(r"KV pressure \(\d+ of \d+ blocks\): (\d+) preemptions, every logits row bitwise equal", out)
    assert preempted and int(preempted.group(1)) >= 1, out
    # Process B loaded the saved step, preempted too, and reproduced every logits row.
    reloaded = re.search(
        r"AOT reload in a fresh process: (\d+) logits rows bitwise equal, (\d+) preemptions, tokens match", out
    )
    assert reloaded and int(reloaded.group(1)) > 100 and int(reloaded.group(2)) >= 1, out
    # Both transports ran against the model that holds its table.
    assert "| offload process |" in out and "| host gather |" in out, out
    assert list(tmp_path.iterdir()) == []  # the disk tier left nothing behind
