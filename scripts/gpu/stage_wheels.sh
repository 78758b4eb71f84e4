#!/usr/bin/env bash
# HERE (no GPU), from the repo root, before the device calls that need FlashAttention-4 / quack / cudnn-frontend
# (benchmarks/mlp_kernels/, benchmarks/attention/candidates.py, bench_vit.py --attention fa4).
#
# The wheels live in a folder outside the tree or in .gpuwhl/ (ignored; NOT .whl/, which holds the service's own
# wheels for scripts/gpu/env.sh), exactly these versions, cp312 / manylinux x86_64 for the GPU image (torch 2.11+cu130,
# so the CuTe DSL's cu13 libs):
#   flash_attn_4 4.0.0b36, nvidia_cutlass_dsl{,_libs_base,_libs_core,_libs_cu13} 4.8.1, quack_kernels 0.6.5,
#   apache_tvm_ffi 0.1.15.post2, torch_c_dlpack_ext 0.1.5, nvidia_cudnn_frontend 1.32.0
# flash-attn-4 4.0.0b36 needs nvidia-cutlass-dsl >= 4.6.2 and quack-kernels >= 0.5.3; quack-kernels 0.6.5 needs
# nvidia-cutlass-dsl >= 4.7 (0.6.4 pins 4.6.2): 4.8.1 + 0.6.5 is the newest pair both accept, and the one the
# Dockerfile installs. (fetch: python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12
#  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform
#  manylinux_2_24_x86_64 -d DIR flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 ... ; the others -
#  torch, cuda-bindings, cuda-pathfinder, einops, cloudpickle, protobuf, nvidia-cudnn-cu13 - are the image's).
#
# One device call carries at most 64 MiB (the working tree included, ~1.5 MiB) and these come to 114 MB:
# nvidia_cutlass_dsl_libs_cu13 alone is 92 MB. So they travel in two ignored folders, one per call:
#   .gpuwhl_stage1/  the first 56 MiB of the cu13 wheel
#   .gpuwhl_stage2/  the rest of it + the 8 other wheels + SHA256SUMS + CU13_NAME      (~53 MiB)
# scripts/gpu/install_wheels.sh parks stage 1 in /tmp on call 1 and puts it all together on call 2
# (the machine must still be warm: make call 2 right after call 1).
#
# usage: bash scripts/gpu/stage_wheels.sh [WHEEL_DIR=.gpuwhl]
set -euo pipefail
src="${1:-.gpuwhl}"
[ -d "$src" ] || { echo "no wheel folder $src (see the comment at the top of $0)" >&2; exit 1; }
missing=0
for pinned in flash_attn_4-4.0.0b36 nvidia_cutlass_dsl-4.8.1 nvidia_cutlass_dsl_libs_base-4.8.1 \
              nvidia_cutlass_dsl_libs_core-4.8.1 nvidia_cutlass_dsl_libs_cu13-4.8.1 quack_kernels-0.6.5 \
              apache_tvm_ffi-0.1.15.post2 torch_c_dlpack_ext-0.1.5 nvidia_cudnn_frontend-1.32.0; do
  name=${pinned%-*}
  count=$(find "$src" -maxdepth 1 -name "${name}-[0-9]*.whl" | wc -l)
  exact=$(find "$src" -maxdepth 1 -name "${pinned}-*.whl" | wc -l)
  if [ "$count" -ne 1 ] || [ "$exact" -ne 1 ]; then
    echo "need exactly one ${name}-*.whl in $src, and it must be ${pinned} (found $count, $exact of that version)" >&2
    missing=1
  fi
done
[ "$missing" -eq 0 ] || exit 1
cu13=$(find "$src" -maxdepth 1 -name 'nvidia_cutlass_dsl_libs_cu13-[0-9]*.whl')
rm -rf .gpuwhl_stage1 .gpuwhl_stage2
mkdir -p .gpuwhl_stage1 .gpuwhl_stage2
(cd "$src" && sha256sum ./*.whl | sed 's#  \./#  #') > .gpuwhl_stage2/SHA256SUMS
split -b 58720256 -d -a 2 "$cu13" .gpuwhl_stage1/cu13.part.   # 56 MiB parts: part 00 stays in stage 1
find .gpuwhl_stage1 -name 'cu13.part.*' ! -name 'cu13.part.00' -exec mv {} .gpuwhl_stage2/ \;
basename "$cu13" > .gpuwhl_stage2/CU13_NAME
find "$src" -maxdepth 1 -name '*.whl' ! -name "$(basename "$cu13")" -exec cp {} .gpuwhl_stage2/ \;
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
for d in .gpuwhl_stage1 .gpuwhl_stage2; do
  size=$(du -sb "$d" | cut -f1)
  printf '%s: %d MiB (+ %d KiB of tracked files)\n' "$d" $((size >> 20)) $((tree >> 10))
  if [ $((size + tree)) -ge $((64 << 20)) ]; then echo "WARNING: $d + the tree is over 64 MiB" >&2; exit 1; fi
done
for d in .gpuwhl_stage1 .gpuwhl_stage2; do
  git check-ignore -q "$d" || { echo "$d must be git-ignored (.gitignore)" >&2; exit 1; }
done
