# What an engine links: the same target names from add_subdirectory(kvring)
# and from find_package(kvring) after `cmake --install`:
#   kvring::kvring   the store, the CPU backend and the CUDA backend where built
#   kvring::pack     snapshots, packs and chunk stores (with kvring::kvring)
#   kvring::handoff  the handoff (with kvring::pack)
#   kvring::core     what kvring::kvring is built on: configs, ring
#                    arithmetic, footprints, f16, SHA-256 and the store's
#                    shared code; it makes no store (make_store is
#                    kvring::kvring's)
# Static libraries of position-independent code, so an engine that is a
# shared object (a Python extension) links them too; their private
# dependencies (hiredis for kvring::pack, UCX for kvring::handoff) are found
# again by kvringConfig.cmake, as this build found them, for the components
# an engine asks for (find_package(kvring COMPONENTS kvring) needs neither).
# They are compiled with hidden visibility, so such a shared object exports
# none of kvring's symbols (nor those of the nlohmann-json code kvring
# compiles in), only the engine's own. Every kvring library is STATIC
# whatever BUILD_SHARED_LIBS says, so a hidden symbol is always resolved
# inside the binary that links it. Installed when KVRING_INSTALL is on (the
# default for the top-level project, not for add_subdirectory).
include(CMakePackageConfigHelpers)

set(kvring_exported kvring_core kvring kvring_pack kvring_handoff)
if(TARGET kvring_cuda)
  list(APPEND kvring_exported kvring_cuda)
endif()
foreach(target IN LISTS kvring_exported)
  string(REGEX REPLACE "^kvring_" "" name ${target})
  set_target_properties(${target} PROPERTIES EXPORT_NAME ${name} POSITION_INDEPENDENT_CODE ON
    CXX_VISIBILITY_PRESET hidden CUDA_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON)
  add_library(kvring::${name} ALIAS ${target})
endforeach()

if(NOT KVRING_INSTALL)
  return()
endif()

# One export set for each component of find_package(kvring): kvringTargets
# (core, kvring and cuda, which need only OpenSSL, Threads and the CUDA
# runtime), kvringPackTargets (pack) and kvringHandoffTargets (handoff).
# kvringConfig.cmake loads a component's file only once that component's
# dependencies are found, so an engine that asks for kvring::kvring alone
# never meets the PkgConfig::HIREDIS and PkgConfig::UCX that pack and
# handoff link. (No file is named kvringTargets-<name>.cmake: the
# kvringTargets.cmake CMake writes loads every such file as a build
# configuration's.)
set(kvring_core_set ${kvring_exported})
list(REMOVE_ITEM kvring_core_set kvring_pack kvring_handoff)
install(TARGETS ${kvring_core_set} EXPORT kvringTargets ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(TARGETS kvring_pack EXPORT kvringPackTargets ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(TARGETS kvring_handoff EXPORT kvringHandoffTargets ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
set(kvring_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/kvring)
foreach(set kvringTargets kvringPackTargets kvringHandoffTargets)
  install(EXPORT ${set} NAMESPACE kvring:: DESTINATION ${kvring_cmake_dir})
endforeach()
install(TARGETS kvring_tool RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
# cuda_store.h declares the CUDA backend, which a build without it lacks.
if(TARGET kvring_cuda)
  install(DIRECTORY include/kvring DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
else()
  install(DIRECTORY include/kvring DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} PATTERN cuda_store.h EXCLUDE)
endif()

# The config file repeats this build's choices of dependencies.
set(kvring_built_cuda FALSE)
if(TARGET kvring_cuda)
  set(kvring_built_cuda TRUE)
endif()
foreach(pair CUDA:kvring_built_cuda HIREDIS:HIREDIS_FOUND UCX:UCX_FOUND STATIC_OPENSSL:KVRING_STATIC_DEPS)
  string(REPLACE ":" ";" pair ${pair})
  list(GET pair 0 key)
  list(GET pair 1 var)
  if(${var})
    set(KVRING_CONFIG_${key} TRUE)
  else()
    set(KVRING_CONFIG_${key} FALSE)
  endif()
endforeach()
configure_package_config_file(cmake/kvringConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/kvringConfig.cmake INSTALL_DESTINATION ${kvring_cmake_dir})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/kvringConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/kvringConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/kvringConfigVersion.cmake
        DESTINATION ${kvring_cmake_dir})

# pkg-config (cmake/kvring.pc.in): the same libraries for an engine built
# without CMake, in link order, with the dependencies as this build found
# them: kvring.pc for all of them, kvring-store.pc for kvring::kvring's.
# Under a relative libdir the prefix is the file's own place, so
# `cmake --install --prefix` anywhere gives a file that points into it.
set(kvring_pc_dir ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
if(IS_ABSOLUTE "${kvring_pc_dir}")
  # An absolute libdir is installed where it says, whatever the prefix.
  set(kvring_pc_prefix "${CMAKE_INSTALL_PREFIX}")
else()
  string(REGEX REPLACE "[^/]+" ".." kvring_pc_up "${kvring_pc_dir}")
  set(kvring_pc_prefix "\${pcfiledir}/${kvring_pc_up}")
endif()
foreach(kind INCLUDEDIR LIBDIR)
  string(TOLOWER ${kind} name)
  if(IS_ABSOLUTE "${CMAKE_INSTALL_${kind}}")
    set(kvring_pc_${name} "${CMAKE_INSTALL_${kind}}")
  else()
    set(kvring_pc_${name} "\${prefix}/${CMAKE_INSTALL_${kind}}")
  endif()
endforeach()
set(kvring_pc_requires "")
set(kvring_pc_store_libs "")
set(kvring_pc_have_cuda 0)
if(TARGET kvring_cuda)
  set(kvring_pc_have_cuda 1)
  string(APPEND kvring_pc_store_libs " -lkvring_cuda")
endif()
string(APPEND kvring_pc_store_libs " -lkvring_core")
if(KVRING_STATIC_DEPS)
  # OpenSSL's static libcrypto by its path, and what it needs.
  string(APPEND kvring_pc_store_libs " ${OPENSSL_CRYPTO_LIBRARY} -ldl")
else()
  list(APPEND kvring_pc_requires libcrypto)
endif()
# hiredis and UCX are in no public header: their link flags only, not a
# Requires that would hand their include folders (with headers such as
# read.h and sds.h) to every engine's compile. They stay in Libs, not
# Libs.private: the libraries are static, and `pkg-config --libs` without
# --static leaves Libs.private out.
set(kvring_pc_dep_flags "")
foreach(dep HIREDIS UCX)
  if(${dep}_FOUND)
    list(APPEND kvring_pc_dep_flags ${${dep}_LDFLAGS})
  endif()
endforeach()
set(kvring_pc_cuda_flags "")
if(TARGET kvring_cuda)
  set(kvring_pc_cuda_flags -L${CUDAToolkit_LIBRARY_DIR} -lcudart_static -ldl -lrt)
endif()
# A -L for a directory every linker of the system searches is left out,
# so the file names no folder of this machine where the libraries are the
# system's: /lib, /usr/lib, /lib64 and /usr/lib64, with their multiarch
# folders. Any other folder keeps its -L (the compiler's cached implicit
# directories may hold a shell's LIBRARY_PATH).
set(kvring_pc_system_dirs "")
foreach(dir /lib /usr/lib /lib64 /usr/lib64)
  list(APPEND kvring_pc_system_dirs ${dir})
  if(CMAKE_LIBRARY_ARCHITECTURE)
    list(APPEND kvring_pc_system_dirs ${dir}/${CMAKE_LIBRARY_ARCHITECTURE})
  endif()
endforeach()
function(kvring_pc_append out)
  set(libs "${${out}}")
  foreach(flag IN LISTS ARGN)
    if(flag MATCHES "^-L(.*[^/])/*$" AND CMAKE_MATCH_1 IN_LIST kvring_pc_system_dirs)
      continue()
    endif()
    string(APPEND libs " ${flag}")
  endforeach()
  set(${out} "${libs}" PARENT_SCOPE)
endfunction()
list(JOIN kvring_pc_requires ", " kvring_pc_requires)
# Two files: kvring.pc, every library (the store, packs and chunk stores,
# the handoff) with hiredis and UCX where this build linked them; and
# kvring-store.pc, the store and its backends alone (kvring::kvring's
# libraries), which never needs hiredis or UCX.
set(kvring_pc_libs "${kvring_pc_store_libs}")
kvring_pc_append(kvring_pc_libs ${kvring_pc_dep_flags} ${kvring_pc_cuda_flags} -pthread)
kvring_pc_append(kvring_pc_store_libs ${kvring_pc_cuda_flags} -pthread)
function(kvring_pc_file kvring_pc_name kvring_pc_description kvring_pc_link)
  configure_file(cmake/kvring.pc.in ${CMAKE_CURRENT_BINARY_DIR}/${kvring_pc_name}.pc @ONLY)
  install(FILES ${CMAKE_CURRENT_BINARY_DIR}/${kvring_pc_name}.pc DESTINATION ${kvring_pc_dir})
endfunction()
kvring_pc_file(kvring "KV-cache store for hybrid-attention language models"
  "-lkvring_handoff -lkvring_pack -lkvring${kvring_pc_libs}")
kvring_pc_file(kvring-store "kvring's KV-cache store and its backends, without packs, chunk stores or the handoff"
  "-lkvring${kvring_pc_store_libs}")
