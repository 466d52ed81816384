// The eager entries of tessera._torch_C as plain METH_FASTCALL functions: their positional arguments arrive as an
// array of borrowed Python objects and are converted straight into the C++ function's parameters. Why not m.def:
// pybind11's generic dispatcher builds a call record (argument vectors, keyword handling, overload loop) for every
// call, ~0.3 us of a 17-argument call on this repo's CPU against ~0.07 us for this (docs/perf/host_overhead.md,
// session 25), and its at::Tensor caster holds a counted copy of each tensor argument, where a torch tensor passed
// from Python can be borrowed for the call (the caller's argument array keeps it alive). Optional tensors still go
// through pybind11's std::optional caster (a counted copy, made and dropped with the GIL held).
//
// The contract the torch layer relies on (python/tessera/_dlpack.py: fast_entry, FALLBACK):
// - an argument that cannot be converted raises TypeError with pybind11's phrase "incompatible function arguments"
//   before anything runs; the caller then takes its checked path, which converts or names the argument;
// - positional arguments only; trailing std::optional parameters may be left out (None);
// - tessera::CudaError -> RuntimeError, other tessera::Error -> ValueError (translate_errors' mapping), pybind11's
//   own exceptions as pybind11 raises them, c10's as torch raises them;
// - the GIL is released around the call unless the entry reads Python objects itself (ReleaseGil false).
//
// Include after torch/csrc/utils/pybind.h.
#pragma once

#include <ATen/core/Tensor.h>
#include <Python.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstddef>
#include <exception>
#include <new>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "options.h"

namespace tessera::python {

// One argument's converter: a torch tensor borrowed from its Python object; anything else through pybind11's caster
// for the parameter's type (with conversion, as pybind11's dispatcher allows for a function of one overload).
template <typename T>
struct FastArg {
  using Caster = pybind11::detail::make_caster<T>;
  Caster caster;
  bool load(PyObject* obj) {
    if (!caster.load(pybind11::handle(obj), true)) return false;
    // A bound class (taken by reference here) loads None as null, which pybind11 refuses only when the function is
    // called: refused here instead, before anything runs.
    if constexpr (std::is_base_of_v<pybind11::detail::type_caster_generic, Caster>) return caster.value != nullptr;
    return true;
  }
  template <typename P>
  decltype(auto) get() {
    return pybind11::detail::cast_op<P>(caster);
  }
};

// The torch tensor a Python object holds, borrowed (valid while the object lives), or null for anything else.
inline const at::Tensor* borrowed_tensor(PyObject* obj) {
  return THPVariable_Check(obj) ? &THPVariable_Unpack(obj) : nullptr;
}

template <>
struct FastArg<at::Tensor> {
  const at::Tensor* tensor = nullptr;
  bool load(PyObject* obj) { return (tensor = borrowed_tensor(obj)) != nullptr; }
  template <typename P>
  const at::Tensor& get() {
    return *tensor;
  }
};

template <typename T>
inline constexpr bool kIsOptional = false;
template <typename T>
inline constexpr bool kIsOptional<std::optional<T>> = true;

// The pending C++ exception as the matching Python error (call inside a catch block).
inline void set_python_error() noexcept {
  try {
    throw;
  } catch (pybind11::error_already_set& e) {
    e.restore();
  } catch (const pybind11::builtin_exception& e) {
    e.set_error();
  } catch (const Error&) {
    translate_errors(std::current_exception());
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::exception&) {
    torch::translate_exception_to_python(std::current_exception());  // c10's errors as torch raises them
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "tessera: an unknown C++ exception");
  }
  if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "tessera: a C++ exception without a Python error");
}

template <auto Fn, bool ReleaseGil>
struct FastCall;

template <typename R, typename... Args, R (*Fn)(Args...), bool ReleaseGil>
struct FastCall<Fn, ReleaseGil> {
  static PyObject* call(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) noexcept {
    try {
      return invoke(args, nargs, std::index_sequence_for<Args...>{});
    } catch (...) {
      set_python_error();
      return nullptr;
    }
  }

 private:
  template <std::size_t... I>
  static PyObject* invoke(PyObject* const* args, Py_ssize_t nargs, std::index_sequence<I...>) {
    std::tuple<FastArg<pybind11::detail::intrinsic_t<Args>>...> in;
    constexpr Py_ssize_t n = sizeof...(Args);
    Py_ssize_t bad = -1;
    if (nargs > n) bad = n;
    // Each argument in order (a left-out one: None where the parameter is optional); the first that does not
    // convert stops the rest.
    else
      (void)(((static_cast<Py_ssize_t>(I) < nargs
                   ? std::get<I>(in).load(args[I])
                   : kIsOptional<pybind11::detail::intrinsic_t<Args>> && std::get<I>(in).load(Py_None)) ||
              (bad = static_cast<Py_ssize_t>(I), false)) &&
             ...);
    if (bad >= 0)
      throw pybind11::type_error("tessera._torch_C: incompatible function arguments (" +
                                 (nargs > n ? std::to_string(nargs) + " given, at most " + std::to_string(n)
                                            : "argument " + std::to_string(bad + 1) + " of " + std::to_string(n)) +
                                 ")");
    if constexpr (std::is_void_v<R>) {
      {
        std::optional<pybind11::gil_scoped_release> no_gil;
        if constexpr (ReleaseGil) no_gil.emplace();
        Fn(std::get<I>(in).template get<Args>()...);
      }
      Py_RETURN_NONE;
    } else {
      R result = [&]() -> R {
        std::optional<pybind11::gil_scoped_release> no_gil;
        if constexpr (ReleaseGil) no_gil.emplace();
        return Fn(std::get<I>(in).template get<Args>()...);
      }();
      return pybind11::detail::make_caster<R>::cast(std::move(result), pybind11::return_value_policy::move,
                                                    pybind11::handle())
          .ptr();
    }
  }
};

// The PyMethodDef of an eager entry (name: a string literal).
template <auto Fn, bool ReleaseGil = true>
PyMethodDef fast_method(const char* name) {
  return {name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&FastCall<Fn, ReleaseGil>::call)),
          METH_FASTCALL,
          "An eager entry of the torch layer: positional arguments in its order (python/src/fastcall.h); use "
          "tessera.*"};
}

}  // namespace tessera::python
