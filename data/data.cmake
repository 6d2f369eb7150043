# Image decoding for the data module (included by strobe/CMakeLists.txt after the components floor):
# libjpeg-turbo, its libjpeg API for decoding (Debian libjpeg62-turbo-dev: jpeg_crop_scanline and
# jpeg_skip_scanlines decode a part of an image) and its TurboJPEG API for headers and the encoder
# (libturbojpeg0-dev), and libpng (libpng-dev). find_path /
# find_library rather than pkg-config, so that packages unpacked under a CMAKE_PREFIX_PATH entry
# (the GPU machine's /opt/gpudeps/usr) are found: their .pc files point at /usr.
find_path(STROBE_TURBOJPEG_INCLUDE_DIR turbojpeg.h REQUIRED)
find_library(STROBE_TURBOJPEG_LIBRARY NAMES turbojpeg REQUIRED)
find_path(STROBE_JPEGLIB_INCLUDE_DIR jpeglib.h REQUIRED)
find_path(STROBE_JCONFIG_INCLUDE_DIR jconfig.h PATH_SUFFIXES ${CMAKE_LIBRARY_ARCHITECTURE} REQUIRED)
find_library(STROBE_JPEG_LIBRARY NAMES jpeg REQUIRED)
find_package(PNG REQUIRED)
target_include_directories(strobe_components PRIVATE ${STROBE_TURBOJPEG_INCLUDE_DIR} ${STROBE_JPEGLIB_INCLUDE_DIR}
                                                     ${STROBE_JCONFIG_INCLUDE_DIR})
target_link_libraries(strobe_components PUBLIC ${STROBE_TURBOJPEG_LIBRARY} ${STROBE_JPEG_LIBRARY} PNG::PNG)

# The data tool (fixtures, listings and raw decodes for tests/python) and the loader benchmark.
add_executable(strobe_data_tool ${PROJECT_SOURCE_DIR}/data/tools/data_tool.cpp)
target_link_libraries(strobe_data_tool PRIVATE strobe_lib)
strobe_use_pch(strobe_data_tool)
if(EXISTS ${PROJECT_SOURCE_DIR}/bench/data/CMakeLists.txt)
  add_subdirectory(${PROJECT_SOURCE_DIR}/bench/data ${CMAKE_BINARY_DIR}/bench_data)
endif()
