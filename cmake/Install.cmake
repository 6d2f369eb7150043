# cmake --install <build> --prefix P: the strobe CLI (bin/), libstrobe.so and libstrobe_ops.so (lib/),
# the public headers (include/, STROBE_PUBLIC_HEADERS and nothing else) and the CMake package
# (lib/cmake/Strobe: find_package(Strobe), cmake/StrobeConfig.cmake.in). Installed programs find
# lib/ through $ORIGIN and libtorch where the build found it (CMAKE_INSTALL_RPATH_USE_LINK_PATH, set
# before the targets exist: CMakeLists.txt). tests/python/test_install.py installs into a temporary
# prefix and builds a consumer against it alone.
include(CMakePackageConfigHelpers)

# STROBE_PUBLIC_HEADERS: CMakeLists.txt (their fingerprint is compiled into strobe: runner/plugins.h).
foreach(header ${STROBE_PUBLIC_HEADERS})
  get_filename_component(dir ${header} DIRECTORY)
  install(FILES ${PROJECT_SOURCE_DIR}/${header} DESTINATION include/${dir})
endforeach()

install(TARGETS strobe RUNTIME DESTINATION bin)
install(TARGETS strobe_lib LIBRARY DESTINATION lib)
install(TARGETS strobe_ops LIBRARY DESTINATION lib)

configure_file(${PROJECT_SOURCE_DIR}/cmake/StrobeConfig.cmake.in ${CMAKE_BINARY_DIR}/package/StrobeConfig.cmake @ONLY)
write_basic_package_version_file(${CMAKE_BINARY_DIR}/package/StrobeConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/package/StrobeConfig.cmake ${CMAKE_BINARY_DIR}/package/StrobeConfigVersion.cmake
  ${PROJECT_SOURCE_DIR}/cmake/StrobePlugin.cmake DESTINATION lib/cmake/Strobe)
