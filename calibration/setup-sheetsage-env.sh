#!/usr/bin/env bash
# Create (or reuse) SheetSage2's environment for `transcriber="sheetsage2"` (docs/covers.md).
#
# SheetSage2 pins torch 2.8, transformers 4.45.2 and numpy 1.24, which cannot share yue2-vllm's environment, so it
# lives in its own venv; yue2-vllm runs it out of process (yue2_vllm/transcription/sheetsage_worker.py).
# Its weights (m-a-p/SheetSage2, CC BY-NC 4.0: non-commercial use) are gated on the Hugging Face Hub: accept its
# terms there and export HF_TOKEN (or `huggingface-cli login`) first.
#
# Usage: bash calibration/setup-sheetsage-env.sh [VENV_DIR [MODELS_DIR]]
#   VENV_DIR    default .venv-sheetsage in the repo root
#   MODELS_DIR  default models/ in the repo root: the snapshot goes to MODELS_DIR/SheetSage2, and the merged copy that
#               loads offline (its MERT-v2-FullSong parent folded in, fp32) to MODELS_DIR/SheetSage2-merged
#   SHEETSAGE2_REVISION=<commit> pins the snapshot (default: the Hub's main; the commit used is recorded either way).
#   SHEETSAGE2_TORCH_INDEX=<url> picks the torch wheels (default: CUDA 12.6 where nvidia-smi sees a GPU, else CPU).
# Needs python3.11 or python3.10 (SheetSage2's), network access and about 6 GB of disk. FFmpeg is not needed:
# yue2-vllm hands SheetSage2 WAV files.
# Idempotent: an environment whose worker check passes (torch 2.8, transformers 4.45.2, the merged model present) is
# left as it is. Writes VENV_DIR/yue2-sheetsage.json (what yue2-vllm reads to find the model) and prints VENV_DIR.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo/.venv-sheetsage}"
models="${2:-$repo/models}"
case "$venv" in /*) ;; *) venv="$PWD/$venv" ;; esac
case "$models" in /*) ;; *) models="$PWD/$models" ;; esac
snapshot="$models/SheetSage2"
merged="$models/SheetSage2-merged"
REPO_ID="m-a-p/SheetSage2"
TORCH_VERSION="2.8.0"
TRANSFORMERS_VERSION="4.45.2"
HUB_VERSION="0.36.0"
worker="$repo/yue2_vllm/transcription/sheetsage_worker.py"

ready() {
  [ -x "$venv/bin/python" ] && [ -f "$venv/yue2-sheetsage.json" ] &&
    "$venv/bin/python" - "$worker" "$merged" "$TORCH_VERSION" "$TRANSFORMERS_VERSION" >/dev/null 2>&1 <<'PY'
import json, subprocess, sys
worker, merged, torch_version, transformers_version = sys.argv[1:5]
done = subprocess.run([sys.executable, worker], input=json.dumps({"protocol": 1, "op": "check", "model_dir": merged}),
                      capture_output=True, text=True, check=True)
answer = json.loads(done.stdout.splitlines()[-1])
assert answer["ok"], answer
assert answer["versions"]["torch"].split("+")[0] == torch_version, answer["versions"]
assert answer["versions"]["transformers"] == transformers_version, answer["versions"]
PY
}

if ! ready; then
  log=$(mktemp -t setup-sheetsage-env.XXXXXX.log)
  trap 'rm -f "$log"' EXIT
  fail() { cat "$log" >&2; echo "setup-sheetsage-env: $1" >&2; exit 1; }
  python=""
  for candidate in python3.11 python3.10; do
    if command -v "$candidate" >/dev/null 2>&1; then python="$candidate"; break; fi
  done
  [ -n "$python" ] || fail "SheetSage2 needs python3.11 or python3.10 on PATH"
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv" >>"$log" 2>&1 || fail "$python -m venv $venv failed"
  pip=("$venv/bin/pip" --disable-pip-version-check -q)
  "${pip[@]}" install -U pip >>"$log" 2>&1 || fail "upgrading pip failed"
  "${pip[@]}" install "huggingface-hub==$HUB_VERSION" >>"$log" 2>&1 || fail "installing huggingface-hub failed"
  mkdir -p "$models"
  revision_args=()
  if [ -n "${SHEETSAGE2_REVISION:-}" ]; then revision_args=(--revision "$SHEETSAGE2_REVISION"); fi
  "$venv/bin/huggingface-cli" download "$REPO_ID" --local-dir "$snapshot" "${revision_args[@]}" >>"$log" 2>&1 ||
    fail "downloading $REPO_ID failed: it is gated; accept its terms on the Hub and export HF_TOKEN"
  if [ -z "${SHEETSAGE2_TORCH_INDEX:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      SHEETSAGE2_TORCH_INDEX="https://download.pytorch.org/whl/cu126"
    else
      SHEETSAGE2_TORCH_INDEX="https://download.pytorch.org/whl/cpu"
    fi
  fi
  "${pip[@]}" install "torch==$TORCH_VERSION" "torchaudio==$TORCH_VERSION" --index-url "$SHEETSAGE2_TORCH_INDEX" \
    >>"$log" 2>&1 || fail "installing torch $TORCH_VERSION from $SHEETSAGE2_TORCH_INDEX failed"
  [ -f "$snapshot/requirements.txt" ] || fail "$snapshot has no requirements.txt (not a SheetSage2 snapshot?)"
  "${pip[@]}" install -r "$snapshot/requirements.txt" >>"$log" 2>&1 || fail "installing $snapshot/requirements.txt failed"
  # The adapter snapshot fetches its MERT-v2-FullSong parent on first load and merges it in fp32; the merged copy
  # loads offline (our worker loads with local_files_only).
  "$venv/bin/python" - "$REPO_ID" "$snapshot" "$merged" "${SHEETSAGE2_REVISION:-main}" >>"$log" 2>&1 <<'PY' ||
import sys
from pathlib import Path
from huggingface_hub import HfApi
from transformers import AutoModel
repo_id, snapshot, merged, revision = sys.argv[1:5]
model = AutoModel.from_pretrained(snapshot, trust_remote_code=True)
model.save_pretrained(merged)
commit = HfApi().model_info(repo_id, revision=revision).sha
Path(merged, "yue2-sheetsage-revision.txt").write_text(commit + "\n", encoding="utf-8")
PY
    fail "loading $snapshot and saving its merged copy to $merged failed"
  "$venv/bin/python" - "$venv/yue2-sheetsage.json" "$merged" "$snapshot" >>"$log" 2>&1 <<'PY' ||
import json, sys
from importlib.metadata import version
from pathlib import Path
record, merged, snapshot = sys.argv[1:4]
Path(record).write_text(json.dumps({
    "model_dir": merged, "snapshot_dir": snapshot,
    "revision": Path(merged, "yue2-sheetsage-revision.txt").read_text(encoding="utf-8").strip(),
    "versions": {name: version(name) for name in ("torch", "transformers", "numpy", "huggingface-hub")},
}, indent=2) + "\n", encoding="utf-8")
PY
    fail "writing $venv/yue2-sheetsage.json failed"
  ready || fail "$venv was set up but the worker's check does not pass (torch $TORCH_VERSION, transformers $TRANSFORMERS_VERSION, $merged)"
fi
echo "$venv"
