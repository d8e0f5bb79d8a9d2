"""Stand-ins for llama.cpp's tools, for testing the bench's plumbing where llama.cpp is not built: they print what
the real tools print (the reply on stdout, timings and counts on stderr) for a fixed reply of one 'x' per token,
and log their command lines."""

from __future__ import annotations

import json
import sys
from pathlib import Path

_TOOL = '''#!{python}
import json, sys
args = sys.argv[1:]
value = lambda flag: args[args.index(flag) + 1]
with open({log!r}, "a") as log:
    log.write(json.dumps([{name!r}] + args) + "\\n")
budget = int(value("-n"))
prompt = open(value("-f")).read()
if {name!r} == "llama-completion":
    shown = budget - 1  # the real tool shows one token fewer than -n
    sys.stdout.write("\\n" + "x" * shown + "\\n")
    sys.stderr.write("prompt eval time =      10.00 ms /     5 tokens\\n")
    sys.stderr.write("       eval time =      {{:.2f}} ms / {{:5d}} runs\\n".format(2.0 * shown, shown))
else:
    sys.stdout.write("\\n\\n" + prompt + "x" * budget + "\\n\\n\\n")
    sys.stderr.write("encoded    5 tokens in    0.010 seconds, speed: 500 t/s\\n")
    sys.stderr.write("decoded {{:4d}} tokens in    {{:.3f}} seconds, speed: 1 t/s\\n".format(budget, 0.001 * budget))
    sys.stderr.write("n_draft   = 3\\nn_predict = {{}}\\n"
                     "n_drafted = 9\\nn_accept  = {{}}\\n".format(budget, budget // 2))
'''


def fake_llama_cpp(root: Path) -> tuple[Path, Path]:
    """A llama.cpp 'source' directory with fake tools under build/bin, and the file their calls are logged to."""
    bin_dir = root / "build" / "bin"
    bin_dir.mkdir(parents=True)
    (root / "convert_hf_to_gguf.py").write_text("raise SystemExit('not a converter')\n")
    calls = root / "calls.jsonl"
    for name in ("llama-completion", "llama-speculative-simple"):
        tool = bin_dir / name
        tool.write_text(_TOOL.format(python=sys.executable, log=str(calls), name=name))
        tool.chmod(0o755)
    return root, calls


def fake_gguf_dir(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "target-f32.gguf").write_bytes(b"GGUF")
    (root / "head.gguf").write_bytes(b"GGUF")
    return root


def logged_calls(calls: Path) -> list[list[str]]:
    return [json.loads(line) for line in calls.read_text().splitlines()]
