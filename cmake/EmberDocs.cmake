# docs_api: the API reference, HTML from the `///` comments of the installed headers, into
# <build>/docs/api/html (`make docs-api`). Only when Doxygen is found; nothing else depends on it.
find_package(Doxygen QUIET)
if(NOT DOXYGEN_FOUND)
  message(STATUS "Doxygen not found: no docs_api target (scripts/install-deps.sh installs it)")
  return()
endif()

# The headers cmake/EmberInstall.cmake installs, read through the build tree's include/ember
# links, so pages name them as users include them (<ember/nn/module.h>). The exclusions mirror
# its install(DIRECTORY) rule: detail/ folders, *_impl.h, the kernels' tensor/cpu and tensor/cuda.
set(_ember_docs_inputs ${EMBER_BUILD_INCLUDE_DIR}/ember/ember.h
                       ${EMBER_BUILD_INCLUDE_DIR}/ember/version.h)
foreach(layer tensor autograd nn distributed)
  list(APPEND _ember_docs_inputs ${EMBER_BUILD_INCLUDE_DIR}/ember/${layer})
endforeach()
list(APPEND _ember_docs_inputs ${PROJECT_SOURCE_DIR}/docs/api.md)

set(DOXYGEN_PROJECT_NAME Ember)
set(DOXYGEN_PROJECT_BRIEF "C++20 distributed neural-network training")
set(DOXYGEN_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/docs/api)
set(DOXYGEN_FILE_PATTERNS *.h *.cuh)
set(DOXYGEN_EXCLUDE_PATTERNS */detail/* *_impl.h */ember/tensor/cpu/* */ember/tensor/cuda/*)
# Namespaces named detail (or detail_*) inside public headers are internal too.
set(DOXYGEN_EXCLUDE_SYMBOLS detail detail_* *::detail *::detail_*)
set(DOXYGEN_USE_MDFILE_AS_MAINPAGE ${PROJECT_SOURCE_DIR}/docs/api.md)
set(DOXYGEN_FULL_PATH_NAMES YES)
set(DOXYGEN_STRIP_FROM_PATH ${EMBER_BUILD_INCLUDE_DIR} ${PROJECT_SOURCE_DIR})
set(DOXYGEN_STRIP_FROM_INC_PATH ${EMBER_BUILD_INCLUDE_DIR})
# Many classes and members are documented only by their names (or by the file's leading `//`
# comment): without EXTRACT_ALL they would have no page at all. WARN_IF_UNDOCUMENTED stays off
# for the same reason; every other warning (bad commands, unknown @param names, unresolved
# references) fails the target, so CI catches a malformed comment.
set(DOXYGEN_EXTRACT_ALL YES)
set(DOXYGEN_EXTRACT_PRIVATE NO)
set(DOXYGEN_EXTRACT_STATIC YES)
set(DOXYGEN_WARN_IF_UNDOCUMENTED NO)
set(DOXYGEN_WARN_AS_ERROR FAIL_ON_WARNINGS)
set(DOXYGEN_QUIET YES)
# The headers as a host C++ compile sees them (__CUDACC__ and __CUDA_ARCH__ undefined). Only
# EMBER_HD is expanded, to nothing: it marks host-and-device functions for nvcc and would
# otherwise head their signatures.
set(DOXYGEN_ENABLE_PREPROCESSING YES)
set(DOXYGEN_MACRO_EXPANSION YES)
set(DOXYGEN_EXPAND_ONLY_PREDEF YES)
set(DOXYGEN_PREDEFINED EMBER_HD=)
# No graphs: with dot the run takes about a minute on two cores instead of a few seconds.
set(DOXYGEN_HAVE_DOT NO)
set(DOXYGEN_CLASS_GRAPH NO)
set(DOXYGEN_GENERATE_TREEVIEW YES)
set(DOXYGEN_SORT_MEMBER_DOCS NO)

doxygen_add_docs(docs_api ${_ember_docs_inputs}
                 WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}
                 COMMENT "API reference (Doxygen) into ${PROJECT_BINARY_DIR}/docs/api/html")
