# FLASHHOPPER_ARCHS=auto (the default of `pip install .`): the kernel families the visible GPUs need.
#   compute capability 9.0 -> 90 (Hopper, sm_90a); 8.x -> 80 (Ampere family); both when there are both.
#   No GPU visible (a CPU build machine, a container without a driver) -> "90;80": the build is for
#   whatever GPU it later meets. A GPU of another kind (e.g. 10.x, 12.x, 7.x) has no kernel family of
#   its own here: it is reported, and if nothing else is visible both families are built.
# The devices are asked through the CUDA runtime (a small program compiled and run here), so that
# CUDA_VISIBLE_DEVICES is honoured exactly as it will be at run time.

# The families for a list of compute capabilities ("9.0;8.6"): sets <out_archs> and <out_from> (how they
# were chosen, for the build log and build_info()). Separate from the probe so that tests can call it.
function(flashhopper_archs_for_caps caps out_archs out_from)
  set(_archs "")
  set(_other "")
  foreach(cap IN LISTS caps)
    if(cap STREQUAL "9.0")
      list(APPEND _archs 90)
    elseif(cap MATCHES "^8\\.[0-9]+$")
      list(APPEND _archs 80)
    else()
      list(APPEND _other ${cap})
    endif()
  endforeach()
  list(REMOVE_DUPLICATES _archs)
  list(SORT _archs COMPARE NATURAL ORDER DESCENDING)
  if(_other)
    list(REMOVE_DUPLICATES _other)
    string(REPLACE ";" ", " _o "${_other}")
    message(WARNING "flashhopper: no kernel family for the visible GPU(s) of compute capability ${_o} "
                    "(Hopper 9.0 and Ampere-class 8.x are supported)")
  endif()
  set(_caps ${caps})
  list(REMOVE_DUPLICATES _caps)
  string(REPLACE ";" ", " _c "${_caps}")
  if(_archs)
    set(_from "auto, visible GPUs (compute capability ${_c})")
  elseif(_caps)
    set(_archs 90 80)
    set(_from "auto, no supported GPU visible (compute capability ${_c}): both families")
  else()
    set(_archs 90 80)
    set(_from "auto, no GPU visible: both families")
  endif()
  set(${out_archs} "${_archs}" PARENT_SCOPE)
  set(${out_from} "${_from}" PARENT_SCOPE)
endfunction()

# Probes the visible GPUs; sets FLASHHOPPER_ARCHS and FLASHHOPPER_ARCHS_FROM in the caller's scope.
function(flashhopper_detect_archs)
  try_run(_run_rc _compile_ok "${CMAKE_BINARY_DIR}/detect_gpus" "${CMAKE_CURRENT_FUNCTION_LIST_DIR}/detect_gpus.cu"
    RUN_OUTPUT_VARIABLE _out
    COMPILE_OUTPUT_VARIABLE _compile_log)
  if(NOT _compile_ok)
    message(WARNING "flashhopper: could not compile the GPU probe (cmake/detect_gpus.cu); "
                    "building both kernel families.\n${_compile_log}")
    set(_out "")
  endif()
  string(REGEX MATCHALL "[0-9]+\\.[0-9]+" _caps "${_out}")
  flashhopper_archs_for_caps("${_caps}" _archs _from)
  set(FLASHHOPPER_ARCHS "${_archs}" PARENT_SCOPE)
  set(FLASHHOPPER_ARCHS_FROM "${_from}" PARENT_SCOPE)
endfunction()
