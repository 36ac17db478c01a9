#!/usr/bin/env bash
# run.sh BUILD_DIR — installs the Ember built in BUILD_DIR to a temporary prefix, builds
# tests/downstream against it with find_package(Ember) (and a second program with pkg-config
# alone), and runs the data-parallel loop with 2 ranks under the installed emberrun, then with a
# comm hook from a plug-in built against the install.
set -euo pipefail
build=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/ember_downstream.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix

cmake --install "$build" --prefix "$prefix" >"$tmp/install.log"
for f in include/ember/ember.h include/ember/tensor/tensor.h bin/emberrun \
         lib/cmake/Ember/EmberConfig.cmake lib/cmake/Ember/EmberConfigVersion.cmake \
         lib/pkgconfig/ember.pc; do
  [ -e "$prefix/$f" ] || { echo "run.sh: the install lacks $f" >&2; exit 1; }
done
# Internal is physical: no detail/ header, *_impl.h, kernel header or launcher header installed.
internal=$(cd "$prefix/include/ember" && find . -path '*/detail/*' -o -name '*_impl.h' \
           -o -path './tensor/cpu/*' -o -path './tensor/cuda/*' -o -path './launcher*')
[ -z "$internal" ] || { echo "run.sh: internal headers were installed:" $internal >&2; exit 1; }

# The downstream project sees the prefix and nothing of Ember's source or build tree.
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$here" -B "$tmp/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$prefix" >"$tmp/configure.log" || { cat "$tmp/configure.log"; exit 1; }
cmake --build "$tmp/build" >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; exit 1; }

export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
# shellcheck disable=SC2046
c++ "$here/pkgconfig.cpp" -o "$tmp/pkgconfig" $(pkg-config --cflags --libs ember)
"$tmp/pkgconfig"

"$prefix/bin/emberrun" --standalone --nproc-per-node 2 "$tmp/build/train_ddp"
# The same with a comm hook from a plug-in built against the install (docs/ddp.md, "Plug-ins").
"$prefix/bin/emberrun" --standalone --nproc-per-node 2 "$tmp/build/train_ddp" \
    "$tmp/build/libmy_hooks.so" doubled_average:scale=1
