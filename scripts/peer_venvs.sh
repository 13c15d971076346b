#!/usr/bin/env bash
# Peers that pin what reshard's test environment cannot hold, each in a venv of its own under
# ~/.cache/reshard-compat/, where the tests and benchmarks that compare against them look
# (tests/test_quantize_ct.py, scripts/bench.py --paths --only quantize); both skip, saying so,
# when a venv is absent.
#   bash scripts/peer_venvs.sh llmcompressor   # llm-compressor 0.14 (model_free_ptq; transformers <= 5.17)
set -euo pipefail
root="${RESHARD_COMPAT_DIR:-$HOME/.cache/reshard-compat}"
for peer in "${@:-llmcompressor}"; do
  case "$peer" in
    llmcompressor)
      venv="$root/llmc"
      python3.11 -m venv "$venv"
      "$venv/bin/pip" install -q torch==2.13.0  # the CPU build on this disk, before anything pulls a CUDA one
      "$venv/bin/pip" install -q llmcompressor==0.14.0.1 'transformers<=5.17'
      "$venv/bin/python" -c "import llmcompressor, compressed_tensors; print('llmcompressor', llmcompressor.__version__, 'compressed-tensors', compressed_tensors.__version__)"
      ;;
    *) echo "unknown peer $peer (llmcompressor)" >&2; exit 2 ;;
  esac
done
