# cmake --install: headers under include/ember/<layer>/, the libraries, bin/emberrun, the CMake
# package (lib/cmake/Ember: EmberConfig, its version file, the exported targets) and
# lib/pkgconfig/ember.pc. Consumers: find_package(Ember) and link Ember::ember (docs/install.md).
include(CMakePackageConfigHelpers)

set(EMBER_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/Ember)

set(_ember_public tensor autograd nn distributed)
set(_ember_targets ember_log ember_store)
foreach(layer ${_ember_public})
  if(TARGET ember_${layer})
    set_target_properties(ember_${layer} PROPERTIES EXPORT_NAME ${layer})
    list(APPEND _ember_targets ember_${layer})
  endif()
endforeach()
set_target_properties(ember_log PROPERTIES EXPORT_NAME log)
set_target_properties(ember_store PROPERTIES EXPORT_NAME store)
# Installed libraries find each other beside them and emberrun finds them in ../lib; both keep
# the non-system directories they were linked from (OpenBLAS's OpenMP build, CUDA).
foreach(t ${_ember_targets})
  set_target_properties(${t} PROPERTIES INSTALL_RPATH "$ORIGIN" INSTALL_RPATH_USE_LINK_PATH ON)
endforeach()
set_target_properties(emberrun ember_flight_analyze PROPERTIES
                      INSTALL_RPATH "$ORIGIN/../${CMAKE_INSTALL_LIBDIR}" INSTALL_RPATH_USE_LINK_PATH ON)

# Ember::ember: everything, as <ember/ember.h> includes everything.
add_library(ember_all INTERFACE)
set_target_properties(ember_all PROPERTIES EXPORT_NAME ember)
target_link_libraries(ember_all INTERFACE ember_distributed)
# The headers are C++20: a consumer compiled at its compiler's default standard (C++17 on
# GCC 12) gets -std=c++20 from whichever target it links.
foreach(t ${_ember_targets} ember_all)
  get_target_property(_type ${t} TYPE)
  if(_type STREQUAL "INTERFACE_LIBRARY")
    target_compile_features(${t} INTERFACE cxx_std_20)
  else()
    target_compile_features(${t} PUBLIC cxx_std_20)
  endif()
endforeach()
add_library(Ember::ember ALIAS ember_all)
foreach(layer ${_ember_public})
  if(TARGET ember_${layer})
    add_library(Ember::${layer} ALIAS ember_${layer})
  endif()
endforeach()

install(TARGETS ${_ember_targets} ember_all EXPORT EmberTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(TARGETS emberrun ember_flight_analyze RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
# Headers users include, and only those: internal is physical. Not installed: detail/ folders,
# *_impl.h, the kernels' headers (tensor/cpu/, tensor/cuda/), and the launcher's (its library
# is not installed; emberrun is). scripts/check_layering.py checks that no installed header
# includes one of these.
foreach(layer tensor autograd nn distributed)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${layer}/
          DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/ember/${layer}
          FILES_MATCHING PATTERN "*.h" PATTERN "*.cuh"
          PATTERN "detail" EXCLUDE PATTERN "*_impl.h" EXCLUDE
          REGEX "/tensor/(cpu|cuda)$" EXCLUDE)
endforeach()
install(FILES ${PROJECT_SOURCE_DIR}/include/ember/ember.h ${EMBER_BUILD_INCLUDE_DIR}/ember/version.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/ember)

install(EXPORT EmberTargets NAMESPACE Ember:: DESTINATION ${EMBER_INSTALL_CMAKEDIR})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/EmberConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/EmberConfig.cmake
                              INSTALL_DESTINATION ${EMBER_INSTALL_CMAKEDIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/EmberConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/EmberConfig.cmake ${PROJECT_BINARY_DIR}/EmberConfigVersion.cmake
        DESTINATION ${EMBER_INSTALL_CMAKEDIR})

set(EMBER_PC_DEFINES "")
if(EMBER_WITH_CUDA)
  set(EMBER_PC_DEFINES "-DEMBER_WITH_CUDA=1")
endif()
configure_file(${PROJECT_SOURCE_DIR}/cmake/ember.pc.in ${PROJECT_BINARY_DIR}/ember.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/ember.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
