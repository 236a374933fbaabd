// The only file that includes pybind11: it exposes the C++ runtime classes
// (channels, streams, requests, PackLayout) as pipeline_ext._C. The tensor kernels
// are torch custom ops instead (ops.cpp, torch.ops.pipeline_ext.*); bound here
// are only their eager entry points, which call them through the dispatcher.
// Each section binds one header; the code it binds lives beside that header.
#include <torch/extension.h>

#include "kernels/pack.h"
#include "ops.h"
#include "runtime/channel.h"
#include "runtime/handle_cache.h"
#include "runtime/interrupt.h"
#include "runtime/ipc_channel.h"
#include "runtime/local_channel.h"
#include "runtime/shm_channel.h"
#include "runtime/stream.h"

namespace py = pybind11;

namespace {

// ---- ops.h, kernels/pack.h ----------------------------------------------------------
// The tensor kernels are torch custom ops (ops.cpp, torch.ops.pipeline_ext.*).
// Bound here: their eager entry points (ops.h says why they exist; each one
// goes through the dispatcher), PackLayout, and layout_of.
void bind_ops(py::module_& m) {
  using pipeline_ext::PackLayout;
  // The copy work runs without the GIL so other Python threads (one per
  // pipeline rank) keep going; a Python kernel on the way (autograd formula,
  // fake kernel, dispatch mode) takes the GIL itself.
  using release = py::call_guard<py::gil_scoped_release>;
  // std::vector, not at::TensorList: pybind11 converts Python lists to the former.
  using Tensors = std::vector<at::Tensor>;
  m.def("call_split", &pipeline_ext::call_split, py::arg("tensor"), py::arg("sizes"), py::arg("dim"), release(),
        "ops.split in eager mode: aten views when they are contiguous, else the split_copy op.");
  m.def(
      "call_concat",
      [](const Tensors& tensors, int64_t dim, const std::optional<at::Tensor>& out) {
        return pipeline_ext::call_concat(tensors, dim, out);
      },
      py::arg("tensors"), py::arg("dim"), py::arg("out") = py::none(), release(),
      "ops.concat in eager mode: the concat op, or concat_out when out is given.");
  m.def(
      "call_pack",
      [](const Tensors& tensors, const std::optional<at::Tensor>& out) { return pipeline_ext::call_pack(tensors, out); },
      py::arg("tensors"), py::arg("out") = py::none(), release(),
      "ops.pack in eager mode: (buffer, PackLayout) from the pack or pack_out op.");
  m.def("call_unpack", &pipeline_ext::unpack, py::arg("buffer"), py::arg("layout"), release(),
        "ops.unpack in eager mode: what the composite unpack op computes, without re-encoding the layout.");
  m.def(
      "layout_of", [](const Tensors& tensors) { return pipeline_ext::layout_of(tensors); }, py::arg("tensors"),
      "The PackLayout that pack(tensors) gives (checks one device, dense tensors), without copying.");
  m.attr("PACK_ALIGNMENT") = pipeline_ext::kPackAlignment;

  py::class_<PackLayout>(m, "PackLayout", "Where each packed tensor lives in a pack() buffer.")
      .def(py::init<>())
      .def_readonly("nbytes", &PackLayout::nbytes)
      .def_property_readonly("dtypes",
                             [](const PackLayout& l) {
                               std::vector<at::ScalarType> r;
                               for (const auto& e : l.entries) r.push_back(e.dtype);
                               return r;
                             })
      .def_property_readonly("shapes",
                             [](const PackLayout& l) {
                               py::list r;
                               for (const auto& e : l.entries) r.append(py::tuple(py::cast(e.shape)));
                               return r;
                             })
      .def_property_readonly("offsets",
                             [](const PackLayout& l) {
                               std::vector<int64_t> r;
                               for (const auto& e : l.entries) r.push_back(e.offset);
                               return r;
                             })
      .def("__len__", [](const PackLayout& l) { return l.entries.size(); })
      .def("encode", &PackLayout::encode)
      .def_static("decode", &PackLayout::decode, py::arg("words"))
      .def("to_tensor", &PackLayout::to_tensor)
      .def_static("from_tensor", &PackLayout::from_tensor, py::arg("tensor"))
      .def("__eq__", [](const PackLayout& a, const PackLayout& b) { return a == b; }, py::is_operator())
      .def("__eq__", [](const PackLayout&, const py::object&) { return false; })
      .def("__repr__", &PackLayout::repr)
      .def(py::pickle([](const PackLayout& l) { return py::tuple(py::cast(l.encode())); },
                      [](const py::tuple& t) { return PackLayout::decode(t.cast<std::vector<int64_t>>()); }));
}

// ---- runtime/stream.h ---------------------------------------------------------
// Makes a stream current for a `with` block (a no-op for CPU streams).
class StreamContext {
 public:
  explicit StreamContext(pipeline_ext::Stream stream) : stream_(stream) {}
  void enter() { guard_ = std::make_unique<pipeline_ext::StreamGuard>(stream_); }
  void exit() { guard_.reset(); }

 private:
  pipeline_ext::Stream stream_;
  std::unique_ptr<pipeline_ext::StreamGuard> guard_;
};

pipeline_ext::CopyDirection direction_of(const std::string& name) {
  if (name == "to_device") return pipeline_ext::CopyDirection::ToDevice;
  if (name == "from_device") return pipeline_ext::CopyDirection::FromDevice;
  throw py::value_error("copy direction must be 'to_device' or 'from_device', got '" + name + "'");
}

void bind_streams(py::module_& m) {
  using pipeline_ext::Event;
  using pipeline_ext::Stream;
  using release = py::call_guard<py::gil_scoped_release>;
  py::class_<Stream>(m, "Stream", "A device stream; every call is a no-op on CPU.")
      .def_static("current", &Stream::current, py::arg("device"), "The device's current (compute) stream.")
      .def_static(
          "copy", [](const at::Device& d, const std::string& dir) { return Stream::copy(d, direction_of(dir)); },
          py::arg("device"), py::arg("direction") = "to_device",
          "The device's dedicated copy stream for 'to_device' or 'from_device'.")
      .def_property_readonly("device", &Stream::device)
      .def_property_readonly("is_cuda", &Stream::is_cuda)
      .def("wait", &Stream::wait, py::arg("event"), "This stream waits (on the device) for event.")
      .def("synchronize", &Stream::synchronize, release())
      .def("query", &Stream::query)
      .def("use", [](const Stream& s) { return StreamContext(s); }, "Context manager making this stream current.")
      .def("__eq__", [](const Stream& a, const Stream& b) { return a == b; }, py::is_operator())
      .def("__repr__", [](const Stream& s) { return "Stream(" + s.device().str() + ", id=" +
                                                    std::to_string(s.native().id()) + ")"; });
  py::class_<StreamContext>(m, "StreamContext")
      .def("__enter__", [](StreamContext& c) { c.enter(); })
      .def("__exit__", [](StreamContext& c, py::args) { c.exit(); });
  py::class_<Event>(m, "Event", "A point on a stream; always complete on CPU.")
      .def(py::init<>())
      .def("record", &Event::record, py::arg("stream"))
      .def("block", &Event::block, py::arg("stream"), "Make stream wait for this event.")
      .def("synchronize", &Event::synchronize, release())
      .def("query", &Event::query)
      .def_property_readonly("is_recorded", &Event::is_recorded);
  m.def("record_stream", &pipeline_ext::record_stream, py::arg("tensor"), py::arg("stream"),
        "Tell the caching allocator tensor is used on stream (no-op on CPU).");
}

// ---- runtime/channel.h, runtime/local_channel.h, runtime/shm_channel.h --------------------------------
void bind_channels(py::module_& m) {
  using namespace pipeline_ext;
  using release = py::call_guard<py::gil_scoped_release>;
  // Leaked on purpose: Python exception types must outlive the interpreter's
  // teardown of this module. ChannelTimeout is also a TimeoutError.
  static auto* channel_error = new py::exception<ChannelError>(m, "ChannelError", PyExc_RuntimeError);
  static auto* channel_timeout = new py::exception<ChannelTimeout>(
      m, "ChannelTimeout", py::make_tuple(*channel_error, py::handle(PyExc_TimeoutError)));
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ChannelTimeout& e) {
      py::set_error(*channel_timeout, e.what());
    } catch (const ChannelError& e) {
      py::set_error(*channel_error, e.what());
    }
  });

  py::class_<Request, std::shared_ptr<Request>>(m, "Request", "A send or receive in flight.")
      .def("is_completed", &Request::is_completed, release())
      .def("wait", &Request::wait, py::arg("timeout_ms"), py::arg("what"), release(),
           "Block (GIL released) at most timeout_ms (< 0: no limit); returns received tensors.");

  // runtime/interrupt.h: a wait ends for a signal whose Python handler raises (Ctrl-C). Handlers run on
  // the main thread only, as Python runs them; a wait on another thread goes on.
  const auto main_thread = py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();
  set_interrupt_check([main_thread] {
    if (PyThread_get_thread_ident() != main_thread) return;
    py::gil_scoped_acquire gil;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  });
  m.def("interrupt_fd", &interrupt_fd,
        "The write end of the signal watcher's pipe, for signal.set_wakeup_fd (starts the watcher).");
  m.def(
      "wait_work",
      [](c10d::Work& work, int64_t timeout_ms, const std::string& what) {
        wait_work(work, Millis(timeout_ms), std::chrono::steady_clock::now(), what);
      },
      py::arg("work"), py::arg("timeout_ms"), py::arg("what"), release(),
      "Wait for a torch.distributed Work as the channels do: bounded, interruptible, named errors.");

  // The multi-process channels: what they share is bound once, on Channel.
  py::class_<Channel, std::shared_ptr<Channel>>(
      m, "Channel", "Packed point-to-point messages between the processes of a group (abstract).")
      .def_property_readonly("rank", &Channel::rank)
      .def_property_readonly("size", &Channel::size)
      .def_property_readonly("device", &Channel::device)
      .def_readonly_static("LAYOUT_WORDS", &Channel::kLayoutWords)
      .def_readonly_static("LAYOUT_TAG_BIT", &Channel::kLayoutTagBit)
      .def("send", &Channel::send, py::arg("tensors"), py::arg("peer"), py::arg("tag"),
           py::arg("expected_layout") = py::none(), py::arg("with_layout") = false, py::arg("out") = py::none(),
           py::arg("owned") = false, release(),
           "Send as one message (packed into `out` when given); returns (Request, PackLayout).")
      .def("recv", &Channel::recv, py::arg("layout"), py::arg("peer"), py::arg("tag"), release())
      .def("recv_layout", &Channel::recv_layout, py::arg("peer"), py::arg("tag"), release())
      .def("begin_step", &Channel::begin_step, py::arg("step"),
           "This rank begins step `step`; earlier steps' messages that no receive took are dropped "
           "(a no-op over a process group).");

  py::class_<ProcessGroupChannel, Channel, std::shared_ptr<ProcessGroupChannel>>(
      m, "ProcessGroupChannel", "Packed point-to-point messages over a torch.distributed ProcessGroup.")
      .def(py::init<c10::intrusive_ptr<c10d::ProcessGroup>, at::Device>(), py::arg("group"), py::arg("device"))
      .def("set_route", &ProcessGroupChannel::set_route, py::arg("peer"), py::arg("send_group"), py::arg("send_peer"),
           py::arg("recv_group"), py::arg("recv_peer"),
           "Messages to `peer` go over send_group (to its rank send_peer), from it over recv_group.")
      .def_property_readonly("batches", &ProcessGroupChannel::batches)
      .def_property_readonly("batch_depth", &ProcessGroupChannel::batch_depth)
      .def("begin_batch", &ProcessGroupChannel::begin_batch)
      .def("end_batch", &ProcessGroupChannel::end_batch, release(),
           "Issue the operations since the outermost begin_batch (coalesced when `batches`).");

  py::class_<ShmChannel, Channel, std::shared_ptr<ShmChannel>>(
      m, "ShmChannel", "A Channel over same-host shared memory (pipeline_ext/comm/transport/channels.py).")
      .def(py::init<int, int, int64_t, int64_t, int64_t>(), py::arg("rank"), py::arg("size"), py::arg("ring_bytes"),
           py::arg("spin_us") = 20, py::arg("slice_ms") = 50)
      .def_property_readonly("name", &ShmChannel::name)
      .def("attach", &ShmChannel::attach, py::arg("peer"), py::arg("name"), release())
      .def("withdraw", &ShmChannel::withdraw)
      .def("unexpected", &ShmChannel::unexpected)
      .def("discarded", &ShmChannel::discarded)
      .def("notify_failure", &ShmChannel::notify_failure, py::arg("step"), py::arg("text"), release(),
           "Tell every peer that step `step` failed here: their waits in it end now with `text`.");

#ifdef WITH_CUDA
  py::class_<IpcChannel, Channel, std::shared_ptr<IpcChannel>>(
      m, "IpcChannel", "A Channel for GPU tensors between the processes of one host over CUDA IPC (comm/transport/channels.py).")
      .def(py::init<std::shared_ptr<ShmChannel>, std::shared_ptr<ShmChannel>, at::Device, int64_t, int64_t>(),
           py::arg("control"), py::arg("acks"), py::arg("device"), py::arg("pool_blocks") = 4,
           py::arg("cache_entries") = 64)
      .def_property_readonly("blocks_exported", &IpcChannel::blocks_exported)
      .def_property_readonly("blocks_idle", &IpcChannel::blocks_idle)
      .def_property_readonly("blocks_in_flight", &IpcChannel::blocks_in_flight)
      .def_property_readonly("handles_cached", &IpcChannel::handles_cached);
  m.def(
      "ipc_export_probe", [](const at::Tensor& tensor) { return py::bytes(ipc_export_probe(tensor)); },
      py::arg("tensor"), "The CUDA IPC handle of a tensor's memory (the transport setup's probe).");
  m.def(
      "ipc_open_probe", [](const std::string& handle, at::Device device) { return ipc_open_probe(handle, device); },
      py::arg("handle"), py::arg("device"), release(),
      "Opens (and closes) a peer's probe handle on `device`: '' when that worked, else why not.");
#endif

  // runtime/handle_cache.h with Python open/close functions: the IPC channel's cache logic, testable on any build.
  using PyCache = HandleCache<py::object, py::object>;
  py::class_<PyCache>(m, "_HandleCache", "A bounded LRU of opened handles keyed by (peer, block), for tests.")
      .def(py::init([](size_t capacity, py::object open, py::object close) {
             return std::make_unique<PyCache>(
                 capacity,
                 [open](int peer, int64_t block, const py::object& arg) { return open(peer, block, arg); },
                 [close](int peer, int64_t block, py::object& value) {
                   try {
                     close(peer, block, value);
                   } catch (py::error_already_set& e) {
                     e.discard_as_unraisable("pipeline_ext._C._HandleCache close");
                   }
                 });
           }),
           py::arg("capacity"), py::arg("open"), py::arg("close"))
      .def("get", &PyCache::get, py::arg("peer"), py::arg("block"), py::arg("arg"))
      .def("contains", &PyCache::contains, py::arg("peer"), py::arg("block"))
      .def("erase", &PyCache::erase, py::arg("peer"), py::arg("block"))
      .def("erase_peer", &PyCache::erase_peer, py::arg("peer"))
      .def("clear", &PyCache::clear)
      .def("keys", [](const PyCache& c) {
        std::vector<std::pair<int, int64_t>> out;
        for (const auto& k : c.keys()) out.emplace_back(k.peer, k.block);
        return out;
      })
      .def_property_readonly("size", &PyCache::size)
      .def_property_readonly("capacity", &PyCache::capacity)
      .def_property_readonly("hits", &PyCache::hits)
      .def_property_readonly("misses", &PyCache::misses)
      .def_property_readonly("evictions", &PyCache::evictions);

  py::class_<LocalHub, std::shared_ptr<LocalHub>>(m, "LocalHub", "Mailboxes between in-process ranks.")
      .def(py::init<std::vector<at::Device>, int64_t, int64_t, bool>(), py::arg("devices"),
           py::arg("capacity") = 4096, py::arg("send_timeout_ms") = 300000, py::arg("copy_streams") = true)
      .def_property_readonly("size", &LocalHub::size)
      .def_property_readonly("capacity", &LocalHub::capacity)
      .def_property_readonly("copy_streams", &LocalHub::copy_streams)
      .def("device", &LocalHub::device, py::arg("rank"))
      .def("pending", &LocalHub::pending)
      .def("close", &LocalHub::close, py::arg("reason"), release())
      .def_property_readonly("closed", &LocalHub::closed);

  // transfer + consume in one call, for a reader on the calling thread (Pipe's Boundary backward).
  m.def(
      "copy_between_devices",
      [](const std::vector<at::Tensor>& tensors, const at::Device& src, const at::Device& dst) {
        return consume(transfer(tensors, src, dst), dst);
      },
      py::arg("tensors"), py::arg("src"), py::arg("dst"), release(),
      "Copy tensors src -> dst on the copy streams; dst's current stream (or the host) waits for them.");

  py::class_<LocalChannel, std::shared_ptr<LocalChannel>>(m, "LocalChannel", "One rank's view of a LocalHub.")
      .def(py::init<std::shared_ptr<LocalHub>, int>(), py::arg("hub"), py::arg("rank"))
      .def_property_readonly("rank", &LocalChannel::rank)
      .def("send", &LocalChannel::send, py::arg("tensors"), py::arg("peer"), py::arg("tag"), py::arg("owned") = false,
           release())
      .def("recv", &LocalChannel::recv, py::arg("peer"), py::arg("tag"), release());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pipeline_ext compiled core: PackLayout, streams/events, send/recv channels (kernels: torch.ops.pipeline_ext)";
#ifdef WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  bind_ops(m);
  bind_streams(m);
  bind_channels(m);
}
