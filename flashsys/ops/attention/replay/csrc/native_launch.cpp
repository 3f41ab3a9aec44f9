// The eager attention call in C++: plan look-up, allocation, kernel launches and the autograd node; and the same
// replays for a compiled graph's opaque attention ops (the Gluon kernels'), without a node.
//
// Why: a Python autograd.Function costs host time per forward + backward before it does anything (its backward
// waits for the GIL on the autograd engine's device thread), and so does Triton's Python launcher per launch; SDPA's
// whole forward + backward costs less than the two (docs/host-cost.md). Everything here replays what the Python path
// (flash_triton.py, replay/plans.py) already did once for the same signature: the kernels it compiled and chose,
// their grids and their arguments. Nothing here decides anything; a signature it has no plan for goes back to
// Python (forward: `forward` returns None; backward: the registered fallback).
//
// A launch is either a CUDA kernel (cuLaunchKernel with the argument words the Python side packed from the
// kernel's PTX parameter list, and for a Gluon kernel its TMA descriptors, encoded here on the call's tensors) or a
// Python callable: on the CPU under Triton's interpreter (that is how CPU CI runs this same node), and for a Gluon
// launch whose descriptors the Python side could not describe for encoding here (gluon/launch.py's GluonReplay).
#include <ATen/Context.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <cuda.h>  // types only (from Triton's bundled headers); the driver is opened with dlopen
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace py = pybind11;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

constexpr size_t kMaxParams = 96;
constexpr size_t kMaxTensorMaps = 12;
constexpr size_t kMaxTensorMapRank = 5;
constexpr size_t kMaxPlans = 1024;  // per table; a full table is emptied, as replay/plans.py's PlanTable

using LaunchKernelFn = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                    CUstream, void**, void**);
using ErrorStringFn = CUresult (*)(CUresult, const char**);
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
LaunchKernelFn cu_launch_kernel = nullptr;
ErrorStringFn cu_error_string = nullptr;
EncodeTiledFn cu_encode_tiled = nullptr;  // null on a driver before CUDA 12: plans with tensor maps are refused

void open_driver() {
  if (cu_launch_kernel != nullptr) return;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) throw std::runtime_error("flashsys native launch: cannot open libcuda.so.1");
  cu_launch_kernel = reinterpret_cast<LaunchKernelFn>(dlsym(lib, "cuLaunchKernel"));
  cu_error_string = reinterpret_cast<ErrorStringFn>(dlsym(lib, "cuGetErrorString"));
  cu_encode_tiled = reinterpret_cast<EncodeTiledFn>(dlsym(lib, "cuTensorMapEncodeTiled"));
  if (cu_launch_kernel == nullptr) throw std::runtime_error("flashsys native launch: no cuLaunchKernel in libcuda");
}

// A Gluon kernel's TMA descriptor parameter: everything cuTensorMapEncodeTiled takes but the address, which is the
// call tensor's in `slot` (Triton's launcher encodes the same from the descriptor: nvidia/driver.py, driver.c).
struct TensorMapParam {
  int param = 0;
  int slot = 0;
  CUtensorMapDataType dtype{};
  cuuint32_t rank = 0;
  cuuint64_t dims[kMaxTensorMapRank] = {};     // innermost first
  cuuint64_t strides[kMaxTensorMapRank] = {};  // bytes, of every dim but the innermost, innermost first
  cuuint32_t box[kMaxTensorMapRank] = {};
  CUtensorMapSwizzle swizzle{};
  CUtensorMapFloatOOBfill fill{};
};

struct Launch {
  // CUDA: the compiled kernel and everything cuLaunchKernel takes. Each kernel parameter is one 8-byte word
  // (little-endian: a 4-byte parameter is the word's low half); `pointers` overwrite words with tensor addresses.
  CUfunction function = nullptr;
  unsigned grid[3] = {0, 0, 0};
  unsigned threads = 0;
  unsigned shared_bytes = 0;
  std::vector<uint64_t> words;
  std::vector<std::pair<int, int>> pointers;  // (parameter index, call-tensor slot)
  std::vector<TensorMapParam> maps;  // parameters that take a 128-byte TMA descriptor instead of a word
  PyObject* keep_alive = nullptr;  // the CompiledKernel that owns `function`; owned, never released
  // Interpreter, or a Gluon launch: run(*call_tensors[slots], *tail) under the GIL.
  PyObject* run = nullptr;  // owned reference, never released (plans live as long as the process)
  std::vector<int> slots;
  PyObject* tail = nullptr;
};

struct Scratch {  // a tensor the launches use after the call's own, allocated anew for each call
  std::vector<int64_t> shape;
  at::ScalarType dtype;
};

struct ForwardPlan {
  std::vector<Launch> launches;
  std::vector<int64_t> lse_shape;
  int64_t window_left, window_right;
  double scale;
  std::vector<Scratch> scratch;  // the decode kernels' partial outputs and logsumexps
};

struct BackwardPlan {
  std::vector<Launch> launches;
  std::vector<int64_t> delta_shape;
  std::vector<Scratch> scratch;  // the one pass's dQ sum and semaphores; the launches that use them initialise them
};

constexpr int kForwardTensors = 5;  // q, k, v, O, L; then the scratch
constexpr int kBackwardTensors = 10;  // q, k, v, O, L, dO, dQ, dK, dV, the (L, D) pairs; then the scratch
constexpr size_t kMaxScratch = 4;

// A plan's scratch tensors, fresh for this call, on q's device, into `out`.
void allocate_scratch(const std::vector<Scratch>& scratch, const at::Tensor& q, at::Tensor* out) {
  for (size_t i = 0; i < scratch.size(); ++i) out[i] = at::empty(scratch[i].shape, q.options().dtype(scratch[i].dtype));
}

// Keys: the bytes of what replay/plans.py keys on (shapes, strides, dtypes, devices, 16-byte alignment, flags).
void append(std::string& key, int64_t x) { key.append(reinterpret_cast<const char*>(&x), sizeof x); }

void append_tensor(std::string& key, const at::Tensor& t) {
  append(key, t.dim());
  for (int64_t s : t.sizes()) append(key, s);
  for (int64_t s : t.strides()) append(key, s);
  append(key, static_cast<int64_t>(t.scalar_type()));
  append(key, static_cast<int64_t>(t.device().type()) * 1024 + t.device().index());
  append(key, static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) & 15));
}

void append_double(std::string& key, double x) {
  int64_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  append(key, bits);
}

using Window = std::optional<std::tuple<int64_t, int64_t>>;

std::string forward_key(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                        std::optional<double> scale, const Window& window) {
  std::string key;
  key.reserve(320);
  for (const at::Tensor* t : {&q, &k, &v}) append_tensor(key, *t);
  append(key, causal);
  append(key, scale.has_value());
  append_double(key, scale.value_or(0.0));
  append(key, window.has_value());
  append(key, window ? std::get<0>(*window) : 0);
  append(key, window ? std::get<1>(*window) : 0);
  return key;
}

// A call whose window and scale the checks already derived (replay/plans.py's `signature_key`): a compiled graph's
// opaque forward op (q, k, v), or a backward behind `backward_key`'s flag.
std::string signature_key(int64_t window_left, int64_t window_right, double scale,
                          std::initializer_list<const at::Tensor*> tensors, std::string key = {}) {
  key.reserve(640);
  append(key, window_left);
  append(key, window_right);
  append_double(key, scale);
  for (const at::Tensor* t : tensors) append_tensor(key, *t);
  return key;
}

std::string backward_key(int64_t window_left, int64_t window_right, double scale,
                         std::initializer_list<const at::Tensor*> tensors) {
  // Which one pass a plan replays depends on the determinism setting. flashsys's own switch drops every plan when
  // it changes; torch.use_deterministic_algorithms does not, so it is in the key (as in calls.planned_backward's).
  std::string flag;
  append(flag, at::globalContext().deterministicAlgorithms());
  return signature_key(window_left, window_right, scale, tensors, std::move(flag));
}

template <typename Plan>
class PlanTable {
 public:
  std::shared_ptr<const Plan> get(const std::string& key) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = plans_.find(key);
    return it == plans_.end() ? nullptr : it->second;
  }
  void put(std::string key, Plan plan) {
    auto value = std::make_shared<const Plan>(std::move(plan));
    std::lock_guard<std::mutex> lock(mutex_);
    if (plans_.size() >= kMaxPlans) plans_.clear();
    plans_.insert_or_assign(std::move(key), std::move(value));
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    plans_.clear();
  }
  size_t size() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return plans_.size();
  }

 private:
  // A mutex, not the GIL: the backward looks plans up on the autograd engine's device thread, which must not wait
  // for the GIL (that wait is most of a Python Function's backward cost). A plan stays alive while a call uses it.
  mutable std::mutex mutex_;
  std::unordered_map<std::string, std::shared_ptr<const Plan>> plans_;
};

PlanTable<ForwardPlan> forward_plans;  // eager calls, keyed by `forward_key` (the user's arguments)
PlanTable<BackwardPlan> backward_plans;  // eager backwards and compiled graphs' opaque backward ops
PlanTable<ForwardPlan> op_forward_plans;  // compiled graphs' opaque forward ops, keyed by `signature_key`
PyObject* backward_fallback = nullptr;  // Python: (q, k, v, o, lse, do, wl, wr, scale) -> (dq, dk, dv)
std::atomic<bool> interpreted_allowed{false};  // CPU tensors (Triton's interpreter): only when CPU tests ask for it

bool plain(const at::Tensor& t) {
  // Functorch wrappers, Python subclasses, dispatch modes, meta tensors, and forward-mode AD tangents take
  // the Python path, whose autograd.Function handles (or refuses) them.
  return t.defined() && !at::isTensorSubclassLike(t) && !t._fw_grad(0).defined();
}

CUstream current_stream(const c10::Device& device) {
  c10::Stream stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device);
  return static_cast<CUstream>(stream.native_handle());
}

void run_in_python(const Launch& l, const at::Tensor* tensors) {
  py::gil_scoped_acquire gil;
  py::tuple args(l.slots.size());
  for (size_t i = 0; i < l.slots.size(); ++i) args[i] = py::cast(tensors[l.slots[i]]);
  py::tuple tail = py::reinterpret_borrow<py::tuple>(l.tail);
  py::reinterpret_borrow<py::object>(l.run)(*(args + tail));
}

[[noreturn]] void driver_failed(const char* what, CUresult r) {
  const char* msg = "unknown error";
  if (cu_error_string != nullptr) cu_error_string(r, &msg);
  throw std::runtime_error(std::string("flashsys native launch: ") + what + " failed: " + msg);
}

void launch_all(const std::vector<Launch>& launches, const at::Tensor* tensors) {
  const c10::Device device = tensors[0].device();
  if (device.is_cpu()) {  // Triton's interpreter
    for (const Launch& l : launches) run_in_python(l, tensors);
    return;
  }
  CUstream stream = current_stream(device);
  uint64_t words[kMaxParams];
  void* params[kMaxParams];
  CUtensorMap maps[kMaxTensorMaps];  // the driver's type is 64-byte aligned, as the encoding requires
  static const cuuint32_t element_strides[kMaxTensorMapRank] = {1, 1, 1, 1, 1};
  for (const Launch& l : launches) {
    if (l.run != nullptr) {  // a launch Python makes itself, on the current stream
      run_in_python(l, tensors);
      continue;
    }
    if (l.grid[0] == 0 || l.grid[1] == 0 || l.grid[2] == 0) continue;  // as Triton: an empty grid launches nothing
    const size_t n = l.words.size();
    std::memcpy(words, l.words.data(), n * sizeof(uint64_t));
    for (const auto& [param, slot] : l.pointers)
      words[param] = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(tensors[slot].data_ptr()));
    for (size_t i = 0; i < n; ++i) params[i] = &words[i];
    for (size_t j = 0; j < l.maps.size(); ++j) {
      const TensorMapParam& m = l.maps[j];
      CUresult r = cu_encode_tiled(&maps[j], m.dtype, m.rank, tensors[m.slot].data_ptr(), m.dims, m.strides, m.box,
                                   element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, m.swizzle,
                                   CU_TENSOR_MAP_L2_PROMOTION_L2_128B, m.fill);
      if (r != CUDA_SUCCESS) driver_failed("cuTensorMapEncodeTiled", r);
      params[m.param] = &maps[j];  // the launch copies the parameter's 128 bytes from here
    }
    CUresult r = cu_launch_kernel(l.function, l.grid[0], l.grid[1], l.grid[2], l.threads, 1, 1, l.shared_bytes,
                                  stream, params, nullptr);
    if (r != CUDA_SUCCESS) driver_failed("cuLaunchKernel", r);
  }
}

// flashsys.ops.attention.layout.empty_output's rule, which a replay must follow as the first call did: (B, N, H, D)
// memory where t keeps its heads inside its sequence dimension, dense otherwise.
at::Tensor empty_output(const at::Tensor& t) {
  if (t.dim() == 4 && t.stride(1) < t.stride(2))
    return at::empty({t.size(0), t.size(2), t.size(1), t.size(3)}, t.options()).transpose(1, 2);
  return at::empty(t.sizes(), t.options());
}

at::Tensor dense_grad(at::Tensor g, const at::Tensor& like) {  // as launcher.dense_do
  if (g.scalar_type() != like.scalar_type()) g = g.to(like.scalar_type());
  if (g.stride(-1) != 1) g = g.contiguous();
  return g;
}

// A forward plan's launches on q, k, v: (O, L). The caller has made q's device the current one.
std::tuple<at::Tensor, at::Tensor> launch_forward(const ForwardPlan& plan, const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v) {
  at::Tensor o = empty_output(q);
  at::Tensor lse = at::empty(plan.lse_shape, q.options().dtype(at::kFloat));
  at::Tensor tensors[kForwardTensors + kMaxScratch] = {q, k, v, o, lse};
  allocate_scratch(plan.scratch, q, tensors + kForwardTensors);
  launch_all(plan.launches, tensors);
  return {o, lse};
}

// A backward plan's launches for a dense dO: (dQ, dK, dV). The caller has made q's device the current one.
std::tuple<at::Tensor, at::Tensor, at::Tensor> launch_backward(const BackwardPlan& plan, const at::Tensor& q,
                                                               const at::Tensor& k, const at::Tensor& v,
                                                               const at::Tensor& o, const at::Tensor& lse,
                                                               const at::Tensor& d_o) {
  at::Tensor dq = empty_output(q), dk = empty_output(k), dv = empty_output(v);
  at::Tensor delta = at::empty(plan.delta_shape, q.options().dtype(at::kFloat));
  at::Tensor tensors[kBackwardTensors + kMaxScratch] = {q, k, v, o, lse, d_o, dq, dk, dv, delta};
  allocate_scratch(plan.scratch, q, tensors + kBackwardTensors);
  launch_all(plan.launches, tensors);
  return {dq, dk, dv};
}

}  // namespace

namespace flashsys {

// Named (not in the anonymous namespace): grad_fn.name() shows it.
struct FlashAttention2TritonNative : public torch::autograd::Function<FlashAttention2TritonNative> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const ForwardPlan* plan) {
    auto [o, lse] = launch_forward(*plan, q, k, v);
    ctx->save_for_backward({q, k, v, o, lse});
    ctx->saved_data["window_left"] = plan->window_left;
    ctx->saved_data["window_right"] = plan->window_right;
    ctx->saved_data["scale"] = plan->scale;
    return o;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (at::GradMode::is_enabled())  // the same refusal as validation.refuse_double_backward
      throw std::runtime_error(
          "FlashAttention2Triton: double backward is not supported (backward ran with create_graph=True, as in "
          "gradgradcheck or a gradient penalty). Use the 'naive' attention backend "
          "(flashsys.ops.attention_reference) for higher-order gradients.");
    variable_list saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &o = saved[3], &lse = saved[4];
    const int64_t wl = ctx->saved_data["window_left"].toInt(), wr = ctx->saved_data["window_right"].toInt();
    const double scale = ctx->saved_data["scale"].toDouble();
    at::Tensor d_o = dense_grad(grads[0], q);
    c10::DeviceGuard device_guard(q.device());
    auto plan = backward_plans.get(backward_key(wl, wr, scale, {&q, &k, &v, &o, &lse, &d_o}));
    if (plan != nullptr && plain(d_o)) {
      auto [dq, dk, dv] = launch_backward(*plan, q, k, v, o, lse, d_o);
      return {dq, dk, dv, at::Tensor()};
    }
    py::gil_scoped_acquire gil;  // no plan: the Python path computes the gradients and makes one
    if (backward_fallback == nullptr) throw std::runtime_error("flashsys native launch: no backward fallback set");
    py::tuple r = py::reinterpret_borrow<py::object>(backward_fallback)(q, k, v, o, lse, d_o, wl, wr, scale);
    return {r[0].cast<at::Tensor>(), r[1].cast<at::Tensor>(), r[2].cast<at::Tensor>(), at::Tensor()};
  }
};

// The node's Python type: as a Python Function's node it has `saved_tensors` (q, k, v, O, L), which the op's
// contract exposes (one (B, Nq) float32 logsumexp) and tests read.
PyObject* saved_tensors(PyObject* self, void* /*unused*/) {
  HANDLE_TH_ERRORS
  auto* node = dynamic_cast<torch::autograd::CppNode<FlashAttention2TritonNative>*>(
      reinterpret_cast<torch::autograd::THPCppFunction*>(self)->cdata.get());
  TORCH_CHECK(node != nullptr, "not a FlashAttention2TritonNative node");
  variable_list saved = node->ctx_.get_saved_variables();  // raises once a backward has freed them, as Python's
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(saved.size()));
  if (out == nullptr) return nullptr;
  for (size_t i = 0; i < saved.size(); ++i) PyTuple_SET_ITEM(out, i, THPVariable_Wrap(saved[i]));
  return out;
  END_HANDLE_TH_ERRORS
}

// What torch's own C++ nodes expose (THP_FUNCTION_DEFAULT_* minus the entries that not every torch declares).
PyGetSetDef node_properties[] = {
    {(char*)"next_functions", torch::autograd::THPCppFunction_next_functions, nullptr, nullptr, nullptr},
    {(char*)"requires_grad", torch::autograd::THPCppFunction_requires_grad, nullptr, nullptr, nullptr},
    {(char*)"metadata", torch::autograd::THPCppFunction_metadata, nullptr, nullptr, nullptr},
    {(char*)"saved_tensors", saved_tensors, nullptr, nullptr, nullptr},
    {nullptr}};
PyMethodDef node_methods[] = {
    {(char*)"_register_hook_dict", torch::autograd::THPCppFunction_register_hook_dict, METH_O, nullptr},
    {(char*)"register_hook", torch::autograd::THPCppFunction_register_hook, METH_O, nullptr},
    {(char*)"register_prehook", torch::autograd::THPCppFunction_register_prehook, METH_O, nullptr},
    {(char*)"name", torch::autograd::THPCppFunction_name, METH_NOARGS, nullptr},
    {nullptr}};
PyTypeObject node_type;

void register_node_type() {
  torch::autograd::_initFunctionPyTypeObject(node_type, "FlashAttention2TritonNativeBackward", node_properties,
                                             node_methods);
  torch::autograd::registerCppFunction(typeid(torch::autograd::CppNode<FlashAttention2TritonNative>), &node_type);
}

}  // namespace flashsys

namespace {

bool launchable(const at::Tensor& q) {
  if (q.is_cuda()) return true;
  return q.is_cpu() && interpreted_allowed;
}

// Whether a call's tensors can take a replay here: all plain (`plain`), the first on a device this side launches on.
bool replayable(std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors)
    if (!plain(*t)) return false;
  return launchable(**tensors.begin());
}

// The eager call: O, or None where there is no plan for this signature (the Python path then runs and makes one).
py::object forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                   std::optional<double> scale, const Window& window) {
  if (!replayable({&q, &k, &v})) return py::none();
  auto plan = forward_plans.get(forward_key(q, k, v, causal, scale, window));
  if (plan == nullptr) return py::none();
  c10::DeviceGuard device_guard(q.device());  // Triton launches on the current device; so do these launches
  return py::cast(flashsys::FlashAttention2TritonNative::apply(q, k, v, plan.get()));
}

// A compiled graph's opaque forward op (its arguments): (O, L), or None where there is no plan for this signature.
// No autograd here: the graph's backward calls the backward op.
py::object op_forward(int64_t window_left, int64_t window_right, double scale, const at::Tensor& q,
                      const at::Tensor& k, const at::Tensor& v) {
  if (!replayable({&q, &k, &v})) return py::none();
  auto plan = op_forward_plans.get(signature_key(window_left, window_right, scale, {&q, &k, &v}));
  if (plan == nullptr) return py::none();
  c10::DeviceGuard device_guard(q.device());
  return py::cast(launch_forward(*plan, q, k, v));
}

// A compiled graph's opaque backward op (its arguments; dO of any strides): (dQ, dK, dV), or None where there is
// no plan for this signature. The eager backward's plans serve it: the keys are the same.
py::object op_backward(int64_t window_left, int64_t window_right, double scale, const at::Tensor& q,
                       const at::Tensor& k, const at::Tensor& v, const at::Tensor& o, const at::Tensor& lse,
                       const at::Tensor& d_o_given) {
  if (!replayable({&q, &k, &v, &o, &lse, &d_o_given})) return py::none();
  at::Tensor d_o = dense_grad(d_o_given, q);
  auto plan = backward_plans.get(backward_key(window_left, window_right, scale, {&q, &k, &v, &o, &lse, &d_o}));
  if (plan == nullptr) return py::none();
  c10::DeviceGuard device_guard(q.device());
  return py::cast(launch_backward(*plan, q, k, v, o, lse, d_o));
}

TensorMapParam tensor_map_param(py::handle spec, size_t n_params, int n_tensors) {
  auto [param, slot, dtype, dims, strides, box, swizzle, fill] =
      spec.cast<std::tuple<int, int, int, std::vector<uint64_t>, std::vector<uint64_t>, std::vector<uint32_t>, int,
                           int>>();
  if (cu_encode_tiled == nullptr)
    throw std::invalid_argument("flashsys native launch: this driver has no cuTensorMapEncodeTiled");
  const size_t rank = dims.size();
  if (rank == 0 || rank > kMaxTensorMapRank || box.size() != rank || strides.size() + 1 != rank)
    throw std::invalid_argument("flashsys native launch: a tensor map's dims, strides and box disagree");
  if (param < 0 || static_cast<size_t>(param) >= n_params || slot < 0 || slot >= n_tensors)
    throw std::invalid_argument("flashsys native launch: tensor map parameter or tensor slot out of range");
  TensorMapParam m;
  m.param = param, m.slot = slot, m.rank = static_cast<cuuint32_t>(rank);
  m.dtype = static_cast<CUtensorMapDataType>(dtype);
  m.swizzle = static_cast<CUtensorMapSwizzle>(swizzle);
  m.fill = static_cast<CUtensorMapFloatOOBfill>(fill);
  std::copy(dims.begin(), dims.end(), m.dims);
  std::copy(strides.begin(), strides.end(), m.strides);
  std::copy(box.begin(), box.end(), m.box);
  return m;
}

Launch make_launch(py::handle spec, int n_tensors) {
  // CUDA: (function, (gx, gy, gz), threads, shared_bytes, words, [(param, slot), ...], compiled kernel,
  //        [(param, slot, dtype, dims, strides, box, swizzle, fill), ...]);
  // Python (the interpreter, or a Gluon launch with descriptors it cannot describe): (run, [slot, ...], tail).
  py::tuple t = py::reinterpret_borrow<py::tuple>(spec);
  Launch l;
  if (t.size() == 8) {
    open_driver();
    l.function = reinterpret_cast<CUfunction>(t[0].cast<uintptr_t>());
    auto grid = t[1].cast<std::tuple<unsigned, unsigned, unsigned>>();
    l.grid[0] = std::get<0>(grid), l.grid[1] = std::get<1>(grid), l.grid[2] = std::get<2>(grid);
    l.threads = t[2].cast<unsigned>();
    l.shared_bytes = t[3].cast<unsigned>();
    l.words = t[4].cast<std::vector<uint64_t>>();
    l.pointers = t[5].cast<std::vector<std::pair<int, int>>>();
    if (l.words.size() > kMaxParams) throw std::invalid_argument("flashsys native launch: too many parameters");
    for (const auto& [param, slot] : l.pointers)
      if (param < 0 || static_cast<size_t>(param) >= l.words.size() || slot < 0 || slot >= n_tensors)
        throw std::invalid_argument("flashsys native launch: pointer parameter or tensor slot out of range");
    for (py::handle item : t[7].cast<py::list>()) l.maps.push_back(tensor_map_param(item, l.words.size(), n_tensors));
    if (l.maps.size() > kMaxTensorMaps) throw std::invalid_argument("flashsys native launch: too many tensor maps");
    l.keep_alive = t[6].ptr();
    Py_INCREF(l.keep_alive);
  } else if (t.size() == 3) {
    l.run = t[0].ptr();
    Py_INCREF(l.run);
    l.slots = t[1].cast<std::vector<int>>();
    for (int slot : l.slots)
      if (slot < 0 || slot >= n_tensors)
        throw std::invalid_argument("flashsys native launch: tensor slot out of range");
    py::tuple tail = t[2].cast<py::tuple>();
    l.tail = tail.ptr();
    Py_INCREF(l.tail);
  } else {
    throw std::invalid_argument("flashsys native launch: a launch is an 8-tuple (CUDA) or a 3-tuple (Python)");
  }
  return l;
}

std::vector<Launch> make_launches(const py::list& specs, int n_tensors) {
  std::vector<Launch> out;
  for (py::handle spec : specs) out.push_back(make_launch(spec, n_tensors));
  return out;
}

using ScratchSpecs = std::vector<std::tuple<std::vector<int64_t>, std::string>>;

// (shape, dtype name) per scratch tensor: the dtypes the decode kernels and the one pass use.
std::vector<Scratch> scratch_buffers(const ScratchSpecs& scratch) {
  static const std::unordered_map<std::string, at::ScalarType> dtypes = {{"float32", at::kFloat},
                                                                        {"int32", at::kInt}};
  if (scratch.size() > kMaxScratch) throw std::invalid_argument("flashsys native launch: too many scratch tensors");
  std::vector<Scratch> buffers;
  for (const auto& [shape, name] : scratch) {
    auto it = dtypes.find(name);
    if (it == dtypes.end()) throw std::invalid_argument("flashsys native launch: scratch dtype " + name);
    buffers.push_back(Scratch{shape, it->second});
  }
  return buffers;
}

void add_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                 std::optional<double> scale, const Window& window, const py::list& launches,
                 std::vector<int64_t> lse_shape, int64_t window_left, int64_t window_right, double resolved_scale,
                 const ScratchSpecs& scratch) {
  std::vector<Scratch> buffers = scratch_buffers(scratch);
  const int n_tensors = kForwardTensors + static_cast<int>(buffers.size());
  forward_plans.put(forward_key(q, k, v, causal, scale, window),
                    ForwardPlan{make_launches(launches, n_tensors), std::move(lse_shape), window_left, window_right,
                                resolved_scale, std::move(buffers)});
}

void add_op_forward(int64_t window_left, int64_t window_right, double scale, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, const py::list& launches, std::vector<int64_t> lse_shape,
                    const ScratchSpecs& scratch) {
  std::vector<Scratch> buffers = scratch_buffers(scratch);
  const int n_tensors = kForwardTensors + static_cast<int>(buffers.size());
  op_forward_plans.put(signature_key(window_left, window_right, scale, {&q, &k, &v}),
                       ForwardPlan{make_launches(launches, n_tensors), std::move(lse_shape), window_left,
                                   window_right, scale, std::move(buffers)});
}

void add_backward(int64_t window_left, int64_t window_right, double scale, const at::Tensor& q, const at::Tensor& k,
                  const at::Tensor& v, const at::Tensor& o, const at::Tensor& lse, const at::Tensor& d_o,
                  const py::list& launches, std::vector<int64_t> delta_shape, const ScratchSpecs& scratch) {
  std::vector<Scratch> buffers = scratch_buffers(scratch);
  const int n_tensors = kBackwardTensors + static_cast<int>(buffers.size());
  backward_plans.put(backward_key(window_left, window_right, scale, {&q, &k, &v, &o, &lse, &d_o}),
                     BackwardPlan{make_launches(launches, n_tensors), std::move(delta_shape), std::move(buffers)});
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flashsys: eager attention calls replayed from plans, with a C++ autograd node";
  flashsys::register_node_type();
  m.def("forward", &forward, "O for a planned signature, else None", py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("causal"), py::arg("scale"), py::arg("window"));
  m.def("op_forward", &op_forward, "(O, L) for a compiled graph's planned forward op, else None");
  m.def("op_backward", &op_backward, "(dQ, dK, dV) for a compiled graph's planned backward op, else None");
  m.def("add_forward", &add_forward);
  m.def("add_op_forward", &add_op_forward);
  m.def("add_backward", &add_backward);
  m.def("set_backward_fallback", [](py::object fn) {
    Py_XDECREF(backward_fallback);
    backward_fallback = fn.release().ptr();
  });
  m.def("allow_interpreted", [](bool allowed) { interpreted_allowed = allowed; });
  m.def("clear", [] {
    forward_plans.clear();
    backward_plans.clear();
    op_forward_plans.clear();
  });
  m.def("sizes", [] {
    return std::make_tuple(forward_plans.size(), backward_plans.size(), op_forward_plans.size());
  });
}
