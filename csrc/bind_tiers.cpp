// Python binding of TierManager: converts ids, keys, tokens and locations, nothing more.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <limits>
#include <optional>
#include <string_view>

#include "py_args.h"
#include "tier_manager.h"
#include "token_ids.h"

namespace py = pybind11;

namespace prefixcache {
namespace {

using Location = std::pair<int32_t, int32_t>;

TierWrite parse_write(const std::string& write) {
  if (write == "on_evict") return TierWrite::kOnEvict;
  if (write == "write_through") return TierWrite::kWriteThrough;
  if (write == "selective") return TierWrite::kSelective;
  throw std::invalid_argument("write policy '" + write + "' is not allowed; allowed values: on_evict, write_through, selective");
}

// A tier's rank from a Python callable: rank(candidate) -> (int, int), two int64s, the
// smallest leaving first. It runs inside a TierManager call, which must not throw part-way:
// a callable that raises or returns anything else ranks the slot first and reports the
// error through sys.unraisablehook (prefixcache.tiers never lets one escape; it keeps the
// policy's error and raises it at the next admission).
struct CallableRank {
  py::object fn;
  NativeKey operator()(const EvictionCandidate& c) const {
    try {
      py::object out = fn(c);
      if (!py::isinstance<py::tuple>(out) || py::len(out) != 2) {
        throw py::type_error("a tier's rank must return (int, int), got " + std::string(py::repr(out)));
      }
      auto pair = py::reinterpret_borrow<py::tuple>(out);
      return {pair[0].cast<int64_t>(), pair[1].cast<int64_t>()};
    } catch (py::error_already_set& err) {
      err.discard_as_unraisable(fn);
    } catch (const std::exception& err) {
      PyErr_SetString(PyExc_TypeError, err.what());
      PyErr_WriteUnraisable(fn.ptr());
    }
    return {std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::min()};
  }
};

// A tier from Python: (num_slots, write, min_hits, eviction, leaves_only, params: dict of OrderParams
// names, keep_on_load, store_threshold, reuse_slots); eviction is a native order's name or a
// callable rank (CallableRank).
TierSpec to_spec(py::handle obj) {
  auto t = py::reinterpret_borrow<py::tuple>(obj);
  if (t.size() != 9) {
    throw py::type_error(
        "a tier is (num_slots, write, min_hits, eviction, leaves_only, params, keep_on_load, store_threshold, "
        "reuse_slots)");
  }
  TierSpec s;
  s.num_slots = saturated_int64(t[0], "num_slots");
  s.write = parse_write(t[1].cast<std::string>());
  s.min_hits = saturated_int64(t[2], "min_hits");
  if (py::isinstance<py::str>(t[3])) {
    s.order = parse_eviction_order(t[3].cast<std::string>());
  } else if (PyCallable_Check(t[3].ptr())) {
    s.rank = CallableRank{py::reinterpret_borrow<py::object>(t[3])};
  } else {
    throw py::type_error("a tier's eviction is a native order's name or a callable rank(candidate) -> (int, int)");
  }
  s.leaves_only = t[4].cast<bool>();
  s.keep_on_load = t[6].cast<bool>();
  s.store_threshold = saturated_int64(t[7], "store_threshold");
  s.reuse_slots = saturated_int64(t[8], "reuse_slots");
  auto params = py::reinterpret_borrow<py::dict>(t[5]);
  for (auto [name, value] : params) {
    const std::string key = name.cast<std::string>();
    const int64_t v = saturated_int64(value, key.c_str());
    if (key == "protect_tokens") s.params.protect_tokens = v;
    else if (key == "size_weight") s.params.size_weight = v;
    else if (key == "protected_threshold") s.params.protected_threshold = v;
    else if (key == "tlru_threshold") s.params.tlru_threshold = v;
    else if (key == "next_prompt_estimate") s.params.next_prompt_estimate = v;
    else throw std::invalid_argument("unknown eviction parameter '" + key + "'");
  }
  return s;
}

std::vector<Location> to_locations(py::handle obj) {
  std::vector<Location> out;
  for (py::handle item : obj) {
    auto pair = py::reinterpret_borrow<py::sequence>(item);
    if (pair.size() != 2) throw py::type_error("a location is (tier, slot)");
    int64_t t = saturated_int64(pair[0], "tier"), s = saturated_int64(pair[1], "slot");
    if (t < -2 || t > (1 << 20) || s < -1 || s > kMaxBlocks) {
      throw std::out_of_range("location (" + std::to_string(t) + ", " + std::to_string(s) + ") is out of range");
    }
    out.emplace_back(static_cast<int32_t>(t), static_cast<int32_t>(s));
  }
  return out;
}

std::optional<std::string_view> optional_key(py::handle obj, const char* what) {
  if (obj.is_none()) return std::nullopt;
  return bytes_view(obj, what);
}

// Token ids as the manager takes them: packed, token_bytes() each (None: none). An id
// beyond int32 for a 4-byte manager is the converter's ValueError naming `tokens`.
class TierTokens {
 public:
  TierTokens(const TierManager& t, py::handle obj) {
    if (obj.is_none()) return;
    // A buffer that holds the ids as the manager keeps them (a backend's array('i') for
    // 4-byte pages, array('q') for 8, or a memoryview slice of one) is read in place,
    // exported for the call: every id of that width is allowed, so nothing is checked
    // that a copy would check, and the export keeps the owner from resizing it.
    borrowed_.emplace(obj.ptr());
    if (borrowed_->held() && packed_ids(borrowed_->view(), t.token_bytes())) {
      view_ = {static_cast<const char*>(borrowed_->view().buf), static_cast<size_t>(borrowed_->view().len)};
      return;
    }
    borrowed_.reset();
    if (t.token_bytes() == 4) {
      narrow_ = read_token_ids<int32_t>(obj, "tokens").ids;
      view_ = {reinterpret_cast<const char*>(narrow_.data()), narrow_.size() * sizeof(int32_t)};
      return;
    }
    TokenIds<int64_t> toks = read_token_ids<int64_t>(obj, "tokens");
    if (!toks.complete()) throw std::invalid_argument("tokens: a tier keeps int64 token ids only");
    wide_ = std::move(toks.ids);
    view_ = {reinterpret_cast<const char*>(wide_.data()), wide_.size() * sizeof(int64_t)};
  }
  TierTokens(const TierTokens&) = delete;
  TierTokens& operator=(const TierTokens&) = delete;
  std::string_view view() const { return view_; }

 private:
  // One dimension, contiguous, native signed ints of `width` bytes.
  static bool packed_ids(const Py_buffer& v, int64_t width) {
    if (v.ndim != 1 || v.itemsize != width || v.format == nullptr) return false;
    if (v.strides != nullptr && v.strides[0] != v.itemsize) return false;
    const std::string_view f(v.format);
    return width == 4 ? (f == "i" || f == "@i") : (f == "q" || f == "@q" || f == "l" || f == "@l");
  }

  std::optional<token_ids_detail::IntBuffer> borrowed_;
  std::vector<int32_t> narrow_;
  std::vector<int64_t> wide_;
  std::string_view view_;
};

py::list locations(const std::vector<Location>& locs) {
  py::list out(locs.size());
  for (size_t i = 0; i < locs.size(); ++i) {
    PyList_SET_ITEM(out.ptr(), i, py::make_tuple(locs[i].first, locs[i].second).release().ptr());
  }
  return out;
}

int32_t tier_arg(py::handle obj) { return static_cast<int32_t>(std::clamp<int64_t>(saturated_int64(obj, "tier"), -1, 1 << 20)); }
int32_t slot_arg(py::handle obj) {
  return static_cast<int32_t>(std::clamp<int64_t>(saturated_int64(obj, "slot"), -1, int64_t{kMaxBlocks}));
}

}  // namespace

void bind_tiers(py::module_& m) {
  py::class_<TierManager>(m, "TierManager", R"doc(
The lower tiers of one cache (host memory, disk) below its device pool: slots keyed by
chained block hash, each tier's eviction order and write policy, the device mirror
demotions read from, and the ordered log of transfers an engine performs.
TierManager(num_device_blocks, block_size, key_size, tiers, keep_tokens, record_events, lineage=False,
token_bytes=8),
each tier (num_slots, write, min_hits, eviction, leaves_only, params, keep_on_load, store_threshold,
reuse_slots), eviction a native order's name or a callable rank(candidate) -> (int, int) (smallest
first; one that raises ranks the slot first and reports through sys.unraisablehook). With
lineage, keys are names and blocks are found by parent key and token ids (follow). Token ids
are kept token_bytes wide (4: int32, the radix tree's; 8: int64). See
csrc/tier_manager.h; prefixcache.tiers wraps it.
)doc")
      .def(py::init([](py::handle num_device_blocks, py::handle block_size, py::handle key_size, py::handle tiers,
                       bool keep_tokens, bool record_events, bool lineage, py::handle token_bytes) {
             std::vector<TierSpec> specs;
             for (py::handle t : tiers) specs.push_back(to_spec(t));
             return std::make_unique<TierManager>(saturated_int64(num_device_blocks, "num_device_blocks"),
                                                  saturated_int64(block_size, "block_size"),
                                                  saturated_int64(key_size, "key_size"), std::move(specs), keep_tokens,
                                                  record_events, lineage, saturated_int64(token_bytes, "token_bytes"));
           }),
           py::arg("num_device_blocks"), py::arg("block_size"), py::arg("key_size"), py::arg("tiers"),
           py::arg("keep_tokens"), py::arg("record_events"), py::arg("lineage") = false, py::arg("token_bytes") = 8)
      .def_property_readonly("num_tiers", &TierManager::num_tiers)
      .def_property_readonly("block_size", &TierManager::block_size)
      .def_property_readonly("key_size", &TierManager::key_size)
      .def_property_readonly("keep_tokens", &TierManager::keep_tokens)
      .def_property_readonly("lineage", &TierManager::lineage)
      .def_property_readonly("token_bytes", &TierManager::token_bytes)
      .def_property_readonly("traffic", &TierManager::traffic, "TOKENS admitted so far (the traffic clock).")
      .def_property_readonly("num_device_cached", &TierManager::num_device_cached)
      .def("num_slots", [](const TierManager& t, py::handle tier) { return t.num_slots(tier_arg(tier)); })
      .def("num_used", [](const TierManager& t, py::handle tier) { return t.num_used(tier_arg(tier)); })
      .def(
          "counters",
          [](const TierManager& t, py::handle tier) {
            const TierCounters& c = t.counters(tier_arg(tier));
            py::dict d;
            d["hits"] = c.hits;
            d["loads"] = c.loads;
            d["stores"] = c.stores;
            d["evictions"] = c.evictions;
            d["demotions"] = c.demotions;
            d["refused"] = c.refused;
            d["errors"] = c.errors;
            d["filtered"] = c.filtered;
            return d;
          },
          py::arg("tier"))
      .def(
          "device_cached",
          [](TierManager& t, py::handle blocks, py::handle keys, py::handle parent, py::handle tokens, int64_t depth,
             int64_t request_tokens, int32_t tag) {
            ByteBuffer packed(keys, "keys");
            t.device_cached(to_ids(blocks), packed.view(), optional_key(parent, "parent"), TierTokens(t, tokens).view(), depth,
                            request_tokens, tag);
          },
          py::arg("blocks"), py::arg("keys"), py::arg("parent"), py::arg("tokens"), py::arg("depth") = 0,
          py::arg("request_tokens") = 0, py::arg("tag") = 0)
      .def(
          "admitted",
          [](TierManager& t, py::handle tokens, py::handle blocks, py::handle request_tokens) {
            return t.admitted(saturated_int64(tokens, "tokens"), to_ids(blocks),
                              saturated_int64(request_tokens, "request_tokens"));
          },
          py::arg("tokens"), py::arg("blocks"), py::arg("request_tokens"))
      .def(
          "device_cached_named",
          [](TierManager& t, py::handle blocks, py::handle parent, py::handle tokens, int64_t depth,
             int64_t request_tokens, int32_t tag) {
            t.device_cached_named(to_ids(blocks), bytes_view(parent, "parent"), TierTokens(t, tokens).view(), depth,
                                  request_tokens, tag);
          },
          py::arg("blocks"), py::arg("parent"), py::arg("tokens"), py::arg("depth") = 0, py::arg("request_tokens") = 0,
          py::arg("tag") = 0)
      .def("new_name", [](TierManager& t) { return py::bytes(t.new_name()); })
      .def("tags_in_use", &TierManager::tags_in_use)
      .def("parents_in_use",
           [](const TierManager& t, py::handle names) { return t.parents_in_use(bytes_view(names, "names")); })
      .def("device_key", [](const TierManager& t, py::handle b) -> py::object {
        auto key = t.device_key(saturated_int64(b, "block"));
        return key ? py::object(py::bytes(*key)) : py::object(py::none());
      })
      .def("device_evicted", [](TierManager& t, py::handle blocks) { t.device_evicted(to_ids(blocks)); })
      .def("device_dropped", [](TierManager& t, py::handle blocks) { t.device_dropped(to_ids(blocks)); })
      .def("device_holders", [](const TierManager& t, py::handle key) { return t.device_holders(bytes_view(key, "key")); })
      .def("device_has", [](const TierManager& t, py::handle b) { return t.device_has(saturated_int64(b, "block")); })
      .def(
          "locate",
          [](const TierManager& t, py::handle key) -> py::object {
            auto [tier, slot] = t.locate(bytes_view(key, "key"));
            if (tier == TierManager::kNowhere) return py::none();
            return py::make_tuple(tier, slot);
          },
          py::arg("key"))
      .def(
          "chain",
          [](const TierManager& t, py::object pool, py::handle keys, py::handle start, py::handle stop) {
            const BlockPool* p = pool.is_none() ? nullptr : &pool.cast<const BlockPool&>();
            ByteBuffer packed(keys, "keys");
            return locations(t.chain(p, packed.view(), saturated_int64(start, "start"), saturated_int64(stop, "stop")));
          },
          py::arg("pool"), py::arg("keys"), py::arg("start"), py::arg("stop"))
      .def(
          "follow",
          [](const TierManager& t, py::handle parent, py::handle tokens) {
            std::string keys;
            auto found = t.follow(bytes_view(parent, "parent"), TierTokens(t, tokens).view(), &keys);
            return py::make_tuple(locations(found), py::bytes(keys));
          },
          py::arg("parent"), py::arg("tokens"),
          "Lineage: the tier slots of the whole blocks of `tokens` after the block keyed `parent`, up to "
          "the first held nowhere, and their keys packed: ([(tier, slot), ...], bytes).")
      .def("pin", [](TierManager& t, py::handle slots) { t.pin(to_locations(slots)); })
      .def("unpin", [](TierManager& t, py::handle slots) { t.unpin(to_locations(slots)); })
      .def(
          "load",
          [](TierManager& t, py::handle sources, py::handle dst, bool promote) {
            t.load(to_locations(sources), to_ids(dst), promote);
          },
          py::arg("sources"), py::arg("dst"), py::arg("promote") = true)
      .def("persist", [](TierManager& t, py::handle tier) { return t.persist(tier_arg(tier)); }, py::arg("tier"))
      .def("finish_loads", [](TierManager& t, py::handle sources) { t.finish_loads(to_locations(sources)); })
      .def("count_hits", [](TierManager& t, py::handle tier, py::handle n) {
        t.count_hits(tier_arg(tier), saturated_int64(n, "n"));
      })
      .def(
          "drop",
          [](TierManager& t, py::handle tier, py::handle slot, bool failed_write) {
            t.drop(tier_arg(tier), slot_arg(slot), failed_write);
          },
          py::arg("tier"), py::arg("slot"), py::arg("failed_write") = false)
      .def(
          "restore",
          [](TierManager& t, py::handle tier, py::handle slot, py::handle key, py::handle parent, py::handle tokens,
             py::handle hits) {
            t.restore(tier_arg(tier), slot_arg(slot), bytes_view(key, "key"), optional_key(parent, "parent"),
                      TierTokens(t, tokens).view(), saturated_int64(hits, "hits"));
          },
          py::arg("tier"), py::arg("slot"), py::arg("key"), py::arg("parent"), py::arg("tokens"), py::arg("hits") = 0)
      .def("slot_key", [](const TierManager& t, py::handle tier, py::handle slot) {
        return py::bytes(t.slot_key(tier_arg(tier), slot_arg(slot)));
      })
      .def("slot_parent", [](const TierManager& t, py::handle tier, py::handle slot) -> py::object {
        auto p = t.slot_parent(tier_arg(tier), slot_arg(slot));
        if (!p) return py::none();
        return py::bytes(*p);
      })
      .def("slot_tokens", [](const TierManager& t, py::handle tier, py::handle slot) {
        auto toks = t.slot_tokens(tier_arg(tier), slot_arg(slot));
        return int_array<int64_t>(toks.data(), toks.size());
      })
      .def("slot_hits", [](const TierManager& t, py::handle tier, py::handle slot) {
        return t.slot_hits(tier_arg(tier), slot_arg(slot));
      })
      .def("used_slots", [](const TierManager& t, py::handle tier) { return t.used_slots(tier_arg(tier)); })
      .def_property_readonly("num_transfers", &TierManager::num_transfers)
      .def("pending", [](const TierManager& t, py::handle tier, py::handle slot) {
        return t.pending(tier_arg(tier), slot_arg(slot));
      })
      .def(
          "drain_transfers",
          [](TierManager& t) {
            std::vector<Transfer> all = t.drain_transfers();
            static_assert(sizeof(Transfer) == 4 * sizeof(int32_t));
            return int_array<int32_t>(reinterpret_cast<const int32_t*>(all.data()), all.size() * 4);
          },
          "The transfers recorded since the last drain, in the order they must run, as one array('i') of "
          "(src_tier, src, dst_tier, dst) quadruples; tier -1 is the device pool.")
      .def(
          "drain_records",
          [](TierManager& t) {
            std::vector<TierRecord> all = t.drain_records();
            py::list out(all.size());
            for (size_t i = 0; i < all.size(); ++i) {
              const TierRecord& r = all[i];
              py::object parent = r.has_parent ? py::object(py::bytes(r.parent)) : py::object(py::none());
              py::object tokens = r.stored ? py::object(int_array<int64_t>(r.tokens.data(), r.tokens.size()))
                                           : py::object(py::none());
              PyList_SET_ITEM(out.ptr(), i,
                              py::make_tuple(r.stored, r.tier, py::bytes(r.key), parent, tokens, r.tag).release().ptr());
            }
            return out;
          },
          "Residency changes since the last drain: (stored, tier, key, parent, tokens, tag) tuples, in order.")
      .def("reset", &TierManager::reset)
      .def(
          "check_invariants",
          [](const TierManager& t, py::object pool) {
            t.check_invariants(pool.is_none() ? nullptr : &pool.cast<const BlockPool&>());
          },
          py::arg("pool") = py::none())
      .def("order", [](const TierManager& t, py::handle tier) { return t.order(tier_arg(tier)); });
}

}  // namespace prefixcache
