#!/usr/bin/env bash
# ON THE GPU MACHINE, from the repo root: FlashAttention-4 + CuTe DSL + quack + cudnn-frontend into
# /tmp/site-packages from the two wheel stages of scripts/gpu/stage_wheels.sh, carried by two device calls
# in a row:
#   call 1, carry [".gpuwhl_stage1"]:  bash scripts/gpu/install_wheels.sh    # parks stage 1 in /tmp
#   call 2, carry [".gpuwhl_stage2"]:  bash scripts/gpu/install_wheels.sh && PYTHONPATH=/tmp/site-packages:. ...
# Call 2 puts the cu13 wheel back together, checks every wheel against SHA256SUMS and installs them
# (--no-deps: torch, cuda-bindings, einops, protobuf, nvidia-cudnn-cu13 are the image's). A later call on the
# same warm machine finds them installed and does nothing (unless FA4 was left out: then it tries again).
# If stage 1 is missing (the machine went cold between the calls), it installs the rest without the CuTe
# DSL (FA4 then reports "unavailable") and says so.
# Then run Python with PYTHONPATH=/tmp/site-packages:. (ops/cutlass_dsl.py adds the DSL's dsl_packages folder,
# which a .pth file would add in a normal install). The folder's name matters: quack fingerprints its epilogues'
# code and treats what is not under a `site-packages` / `dist-packages` folder as its own, recursing into the
# DSL's globals, where it fails (a TypeError on cutlass's _LOC_TRANSFORMS ContextVar; ops/quack_gemm.py).
# Not /tmp/site: scripts/gpu/env.sh installs the service's wheels there (both can be on PYTHONPATH).
# Exit status 0 unless pip fails.
set -uo pipefail
park=/tmp/gpuwhl
site=/tmp/site-packages
mkdir -p "$park"
for stage in .gpuwhl_stage1 .gpuwhl_stage2; do
  if [ -d "$stage" ]; then cp "$stage"/* "$park"/ && echo "parked $stage in $park"; fi
done
if grep -qs flash_attn_4 "$site/.installed"; then echo "already installed in $site: $(cat "$site/.installed")"; exit 0; fi
if [ ! -f "$park/SHA256SUMS" ]; then
  echo "stage 1 parked; now call 2 with carry [\".gpuwhl_stage2\"] right away (the machine stays warm ~30 s)"
  exit 0
fi
cd "$park" || exit 1
name=$(cat CU13_NAME)
if [ -f cu13.part.00 ]; then
  cat cu13.part.* > "$name" && rm -f cu13.part.*
elif [ ! -f "$name" ]; then
  echo "WARNING: stage 1 (cu13.part.00) is missing: the machine went cold between the calls. Installing" \
       "without the CuTe DSL: FA4 and cudnn-frontend's python engines will be unavailable."
  rm -f cu13.part.*
fi
wheels=()
while read -r sum file; do
  [ -f "$file" ] || continue
  if echo "$sum  $file" | sha256sum -c --quiet -; then wheels+=("$park/$file"); else echo "BAD CHECKSUM: $file"; fi
done < SHA256SUMS
cd - > /dev/null || exit 1
if ! printf '%s\n' "${wheels[@]}" | grep -q nvidia_cutlass_dsl_libs_cu13; then
  # without the cu13 libs the DSL cannot load: leave it (and what needs it) out so imports fail cleanly
  mapfile -t wheels < <(printf '%s\n' "${wheels[@]}" | grep -v -e nvidia_cutlass_dsl -e flash_attn_4 -e quack_kernels)
fi
rm -rf "$site"
if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${wheels[@]}" \
     > "$park/pip.log" 2>&1; then
  cat "$park/pip.log"
  echo "pip install failed"
  exit 1
fi
grep -v "Running pip as the 'root' user" "$park/pip.log" || true
printf '%s\n' "${wheels[@]##*/}" | tr '\n' ' ' > "$site/.installed"
echo "installed into $site: $(cat "$site/.installed")"
PYTHONPATH="$site:." python3 -c "
import torch
from encoder_service.ops import attention_fa4, quack_gemm
print('fa4 available:', attention_fa4.available(torch.device('cuda')))
print('quack available:', quack_gemm.available(torch.device('cuda')))
" 2>&1 | tail -4
exit 0
