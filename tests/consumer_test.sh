#!/usr/bin/env bash
# An engine's build against kvring (tests/consumer): MODE "installed" installs
# BUILD into a prefix and uses find_package(kvring), then builds the same
# programs with the compiler alone through the prefix's kvring.pc
# (pkg-config), and the README example through kvring-store.pc;
# "subdirectory" adds the source tree with add_subdirectory (CPU backend
# only, to keep it short).
# usage: consumer_test.sh MODE SOURCE BUILD WORK README_EXAMPLE GENERATOR
set -euo pipefail
mode=$1 src=$2 build=$3 work=$4 example=$5 generator=$6
# A step's output is shown only when it fails.
quiet() { "$@" >"$work/step.log" 2>&1 || { cat "$work/step.log" >&2; return 1; }; }
# A shared object that links kvring's static libraries exports its own
# symbols only (engine_module.cc's entry point): none of kvring's, nor of the
# nlohmann-json code kvring compiles in.
own_exports_only() {
  nm -DC --defined-only "$1" >"$work/exports"
  grep -q engine_module_free_blocks "$work/exports"
  if grep -E 'kvring|nlohmann' "$work/exports" >&2; then echo "$1 exports the lines above" >&2; return 1; fi
}
rm -rf "$work"
mkdir -p "$work"
args=(-G "$generator" -DCMAKE_BUILD_TYPE=Release -DREADME_EXAMPLE="$example")
case $mode in
  installed)
    quiet cmake --install "$build" --prefix "$work/prefix"
    args+=(-DCMAKE_PREFIX_PATH="$work/prefix") ;;
  subdirectory)
    args+=(-DKVRING_SOURCE="$src" -DKVRING_CUDA=OFF) ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
quiet cmake -S "$src/tests/consumer" -B "$work/build" "${args[@]}"
quiet cmake --build "$work/build" -j"$(nproc)"
# Each program must exit 0 and say what it checked.
"$work/build/readme_example" | tee "$work/readme.out"
grep -q "a at 6, draft at 4" "$work/readme.out"
"$work/build/pack_round_trip" | tee "$work/pack.out"
grep -q "pack of [0-9]* bytes restored: 3 layers equal" "$work/pack.out"
own_exports_only "$work/build/libengine_module.so"

if [ "$mode" = subdirectory ]; then
  # kvring's own programs are left out of the engine's build.
  left=$(find "$work/build/kvring" -type f -perm -u+x \( -name kvring -o -name 'kvring-*' \))
  [ -z "$left" ] || { echo "built in the engine's build: $left" >&2; exit 1; }
  exit 0
fi
pc=$(find "$work/prefix" -name kvring.pc -path "*/pkgconfig/*")
test -n "$pc"

# An engine that asks for kvring's components finds them where pkg-config
# finds no module, as on a machine without hiredis's or UCX's development
# packages: kvring alone builds and runs the README example; pack and
# handoff, where this build linked hiredis or UCX, leave kvring not found
# with a message naming the module.
components() {
  env -u PKG_CONFIG_PATH PKG_CONFIG_LIBDIR="$work/no-pc" \
    cmake -S "$src/tests/consumer" -B "$work/components" "${args[@]}" -DKVRING_COMPONENTS="$1"
}
mkdir "$work/no-pc"
quiet components kvring
quiet cmake --build "$work/components"
"$work/components/readme_example" | grep "a at 6, draft at 4"
refused() {  # component module
  if components "$1" >"$work/step.log" 2>&1; then
    echo "kvring's component $1 found without $2" >&2; exit 1
  fi
  grep -q "component $1 needs .*$2" "$work/step.log" || { cat "$work/step.log" >&2; exit 1; }
}
if grep -q -- "-lhiredis" "$pc"; then refused pack hiredis; fi
if grep -q -- "-lucp" "$pc"; then refused handoff ucx; fi

# An engine built without CMake: the compiler and pkg-config alone.
export PKG_CONFIG_PATH="$(dirname "$pc")"
# The CUDA backend's header is installed with the backend only; the
# dependencies' include folders stay out of an engine's compile.
cuda_header=$(find "$work/prefix" -name cuda_store.h -path "*/kvring/*")
if grep -q -- "-DKVRING_HAVE_CUDA=0" "$pc"; then test -z "$cuda_header"; else test -n "$cuda_header"; fi
if pkg-config --cflags kvring | grep -q hiredis; then echo "kvring.pc hands out hiredis's include folder" >&2; exit 1; fi
# Libs names no folder the linker searches by default.
libs="$(grep '^Libs:' "$pc") "
multiarch=$("${CXX:-c++}" -print-multiarch 2>/dev/null || true)
for dir in /lib /usr/lib ${multiarch:+/lib/$multiarch /usr/lib/$multiarch}; do
  case $libs in *" -L$dir "* | *" -L$dir/ "*) echo "kvring.pc: Libs names $dir" >&2; exit 1 ;; esac
done
pkg_cxx() { quiet "${CXX:-c++}" -std=c++20 "$@" $(pkg-config --cflags --libs kvring); }
pkg_cxx "$example" -o "$work/readme_pc"
pkg_cxx "$src/tests/consumer/pack_round_trip.cc" -o "$work/pack_pc"
pkg_cxx -shared -fPIC -fvisibility=hidden -fvisibility-inlines-hidden "$src/tests/consumer/engine_module.cc" \
  -o "$work/libengine_module_pc.so"
"$work/readme_pc" | grep "a at 6, draft at 4"
# kvring-store.pc: the store alone, which links neither hiredis nor UCX.
store_libs=$(pkg-config --libs kvring-store)
case " $store_libs " in *kvring_pack* | *kvring_handoff* | *hiredis* | *-lucp* | *-lucs*)
  echo "kvring-store.pc: Libs names $store_libs" >&2; exit 1 ;; esac
quiet "${CXX:-c++}" -std=c++20 "$example" -o "$work/readme_store_pc" $(pkg-config --cflags --libs kvring-store)
"$work/readme_store_pc" | grep "a at 6, draft at 4"
"$work/pack_pc" | grep "pack of [0-9]* bytes restored: 3 layers equal"
own_exports_only "$work/libengine_module_pc.so"
