# Locates the CUTLASS/CuTe headers.
#   -DCUTLASS_INCLUDE_DIR=/path/to/include   wins when given (the GPU machine has no network);
#   otherwise the headers of the PyPI package nvidia-cutlass (module cutlass_library) installed
#   in the Python that drives the build are used: <site-packages>/cutlass_library/source/include.
# Defines Cutlass_FOUND, CUTLASS_INCLUDE_DIR, CUTLASS_VERSION and the target Cutlass::headers.

if(NOT CUTLASS_INCLUDE_DIR)
  if(NOT Python_EXECUTABLE)
    find_package(Python COMPONENTS Interpreter REQUIRED)
  endif()
  # find_spec does not import the package, so no dependency of cutlass_library is needed.
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
      "import importlib.util, os; s = importlib.util.find_spec('cutlass_library'); print(os.path.join(list(s.submodule_search_locations)[0], 'source', 'include') if s else '')"
    OUTPUT_VARIABLE _cutlass_py_include
    OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _cutlass_py_rc)
  if(_cutlass_py_rc EQUAL 0 AND EXISTS "${_cutlass_py_include}/cutlass/cutlass.h")
    set(CUTLASS_INCLUDE_DIR "${_cutlass_py_include}" CACHE PATH "CUTLASS include directory" FORCE)
  endif()
endif()

if(CUTLASS_INCLUDE_DIR AND EXISTS "${CUTLASS_INCLUDE_DIR}/cutlass/version.h")
  file(STRINGS "${CUTLASS_INCLUDE_DIR}/cutlass/version.h" _v REGEX "#define CUTLASS_(MAJOR|MINOR|PATCH) ")
  string(REGEX REPLACE ".*CUTLASS_MAJOR ([0-9]+).*" "\\1" _maj "${_v}")
  string(REGEX REPLACE ".*CUTLASS_MINOR ([0-9]+).*" "\\1" _min "${_v}")
  string(REGEX REPLACE ".*CUTLASS_PATCH ([0-9]+).*" "\\1" _pat "${_v}")
  set(CUTLASS_VERSION "${_maj}.${_min}.${_pat}")
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(Cutlass
  REQUIRED_VARS CUTLASS_INCLUDE_DIR
  VERSION_VAR CUTLASS_VERSION
  REASON_FAILURE_MESSAGE
    "CUTLASS headers not found. Install the headers package (pip install nvidia-cutlass==4.2.0.0) or pass -DCUTLASS_INCLUDE_DIR=<cutlass>/include.")

if(Cutlass_FOUND AND NOT TARGET Cutlass::headers)
  add_library(Cutlass::headers INTERFACE IMPORTED)
  set_target_properties(Cutlass::headers PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${CUTLASS_INCLUDE_DIR}")
endif()
