#!/usr/bin/env bash
# Keep Triton's compiled kernels from one device call to the next (each call gets a fresh machine, and the
# GPU tests and sweeps spend most of a call building kernels on its CPUs):
#
#   source bench/triton_cache.sh restore   # TRITON_CACHE_DIR=/tmp/tcache, unpacked from .tcache/ if carried
#   ...                                    # the call's work
#   bash bench/triton_cache.sh save        # $OUT/triton-cache.tar.gz: cubins, metadata, launchers (no IRs)
#
# Copy the saved archive into .tcache/ (git-ignored) and name .tcache in the next call's `carry`. Cache entries
# are keyed by Triton's version, the kernel source and its specialisation, so a changed kernel simply builds
# again; the archive must stay under the 16 MiB a returned file may have (`save` says when it does not).
TCACHE=/tmp/tcache
case "${1:-}" in
  restore)
    export TRITON_CACHE_DIR=$TCACHE
    mkdir -p "$TCACHE"
    if [ -f .tcache/triton-cache.tar.gz ]; then
      tar -xzf .tcache/triton-cache.tar.gz -C "$TCACHE" && echo "triton cache: $(ls "$TCACHE" | wc -l) entries restored"
    fi
    ;;
  save)
    out=${OUT:?OUT must name the folder that comes back}/triton-cache.tar.gz
    (cd "$TCACHE" && find . -type f \( -name '*.json' -o -name '*.cubin' -o -name '*.so' \) -print0 \
      | tar -czf "$out" --null -T -)
    size=$(stat -c %s "$out")
    echo "triton cache: $(ls "$TCACHE" | wc -l) entries, $((size / 1048576)) MiB packed"
    if [ "$size" -ge $((16 * 1048576)) ]; then rm -f "$out"; echo "triton cache: over 16 MiB, not kept"; fi
    ;;
  *)
    echo "usage: source bench/triton_cache.sh restore | bash bench/triton_cache.sh save" >&2
    ;;
esac
