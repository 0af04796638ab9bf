// pybind11 bindings: ngram_service._native.  The typed Python API lives in
// ngram_service/trie.py, tree_search.py and build.py; this layer converts
// numpy arrays, maps C++ exceptions and releases the GIL in long calls.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <string>

#include "builder.hpp"
#include "context_index.hpp"
#include "level_writer.hpp"
#include "reference_trie.hpp"
#include "search.hpp"
#include "trie.hpp"

namespace py = pybind11;
using namespace dart_ngram;

namespace {

using I64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using F32Array = py::array_t<float, py::array::c_style | py::array::forcecast>;
using U32Array = py::array_t<uint32_t, py::array::c_style | py::array::forcecast>;
using U64Array = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;
using I32Array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using F64Array = py::array_t<double, py::array::c_style | py::array::forcecast>;

template <typename T>
py::array_t<T> to_array(std::vector<T>&& v, std::vector<py::ssize_t> shape) {
  auto* heap = new std::vector<T>(std::move(v));
  py::capsule owner(heap, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>(shape, heap->data(), owner);
}

// A build's statistics (builder.hpp): the fields every build fills, plus those of finish_levels().
py::dict build_stats(const BuildStats& s) {
  py::dict d;
  d["total_tokens"] = s.total_tokens;
  d["num_nodes"] = s.num_nodes;
  d["nodes_per_level"] = s.nodes_per_level;
  d["file_bytes"] = s.file_bytes;
  d["num_runs"] = s.num_runs;
  d["spilled_bytes"] = s.spilled_bytes;
  d["max_count_per_level"] = s.max_count_per_level;
  return d;
}

py::dict tree_to_dict(DraftTreeData&& t) {
  const auto n = static_cast<py::ssize_t>(t.tokens.size());
  py::dict d;
  d["tokens"] = to_array(std::move(t.tokens), {n});
  d["parents"] = to_array(std::move(t.parents), {n});
  d["depths"] = to_array(std::move(t.depths), {n});
  d["scores"] = to_array(std::move(t.scores), {n});
  d["probs"] = to_array(std::move(t.probs), {n});
  d["tree_mask"] = to_array(std::move(t.tree_mask), {n, n});
  d["retrieve_indices"] = to_array(std::move(t.retrieve), {t.num_leaves, t.max_depth + 1});
  return d;
}

void check_chain(const I64Array& chain, const F32Array& probs) {
  if (chain.ndim() != 1 || probs.ndim() != 1 || chain.shape(0) != probs.shape(0)) {
    throw std::invalid_argument("a chain and its probabilities must be 1-D and of the same length");
  }
}

void check_rows_shape(const I32Array& parents, const I64Array& counts) {
  if (parents.ndim() != 2 || counts.ndim() != 1 || counts.shape(0) != parents.shape(0)) {
    throw std::invalid_argument("parents must be [B, N] and counts [B]");
  }
}

void check_topk(const I64Array& ids, const F32Array& probs, int ndim) {
  if (ids.ndim() != ndim || probs.ndim() != ndim) {
    throw std::invalid_argument("topk_ids and topk_probs must have " + std::to_string(ndim) + " dimensions");
  }
  for (int i = 0; i < ndim; ++i) {
    if (ids.shape(i) != probs.shape(i)) throw std::invalid_argument("topk_ids and topk_probs shapes differ");
  }
}

// search_trees over checked arrays (the GIL released during the search); with_layout as search_tree's.
std::vector<DraftTreeData> search_batch(const SearchParams& params, const MappedTrie* trie, const I64Array& ids,
                                        const F32Array& probs, const I64Array& contexts, const I64Array& offsets,
                                        const I64Array& chains, const F32Array& chain_probs,
                                        const I64Array& chain_offsets, bool with_layout) {
  check_topk(ids, probs, 3);
  const int batch = static_cast<int>(ids.shape(0));
  if (offsets.ndim() != 1 || offsets.shape(0) != batch + 1) {
    throw std::invalid_argument("context offsets must be [batch + 1]");
  }
  const int64_t* off = offsets.data();
  if (off[0] != 0 || off[batch] != contexts.size()) {
    throw std::invalid_argument("context offsets must start at 0 and end at the context length");
  }
  check_chain(chains, chain_probs);
  const int64_t* coff = chain_offsets.data();
  if (chain_offsets.ndim() != 1 || chain_offsets.shape(0) != batch + 1 || coff[0] != 0 ||
      coff[batch] != chains.size()) {
    throw std::invalid_argument("chain offsets must be [batch + 1], from 0 to the chain length");
  }
  py::gil_scoped_release release;
  return search_trees(params, trie, ids.data(), probs.data(), batch, static_cast<int>(ids.shape(1)),
                      static_cast<int>(ids.shape(2)), contexts.data(), off, chains.data(), chain_probs.data(), coff,
                      with_layout);
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "dart-serve n-gram trie, builder and DART tree search (C++)";
  py::register_exception<TrieFormatError>(m, "TrieFormatError", PyExc_ValueError);
  py::register_exception<ReferenceFormatError>(m, "ReferenceFormatError", PyExc_ValueError);

  py::class_<MappedTrie, std::shared_ptr<MappedTrie>>(m, "MappedTrie")
      .def(py::init<const std::string&>(), py::arg("path"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("order", &MappedTrie::order)
      .def_property_readonly("vocab_size", [](const MappedTrie& t) { return t.header().vocab_size; })
      .def_property_readonly("total_tokens", [](const MappedTrie& t) { return t.header().total_tokens; })
      .def_property_readonly("num_nodes", [](const MappedTrie& t) { return t.header().num_nodes; })
      .def_property_readonly("file_bytes", [](const MappedTrie& t) { return t.header().file_bytes; })
      .def_property_readonly("header_bytes", [](const MappedTrie& t) { return t.header().header_bytes; })
      .def_property_readonly("payload_crc32", [](const MappedTrie& t) { return t.header().payload_crc32; })
      .def_property_readonly("nodes_per_level",
                             [](const MappedTrie& t) {
                               std::vector<uint64_t> v;
                               for (int i = 0; i < t.order(); ++i) v.push_back(t.header().levels[i].num_nodes);
                               return v;
                             })
      .def_property_readonly("metadata_json", &MappedTrie::metadata_json)
      .def(
          "count",
          [](const MappedTrie& t, const U32Array& ngram) -> uint64_t {
            if (ngram.ndim() != 1) throw std::invalid_argument("ngram must be 1-D");
            NodeRef node;
            if (!t.find(ngram.data(), ngram.size(), &node)) return 0;
            return t.count(node);
          },
          py::arg("ngram"))
      .def(
          "probability",
          [](const MappedTrie& t, const I64Array& contexts, const I64Array& offsets, const I64Array& tokens) {
            // contexts: flat [sum(len)], offsets: [batch + 1], tokens: [batch, num_tokens]
            if (tokens.ndim() != 2 || offsets.ndim() != 1 || offsets.shape(0) != tokens.shape(0) + 1) {
              throw std::invalid_argument("tokens must be [batch, n] and offsets [batch + 1]");
            }
            const py::ssize_t batch = tokens.shape(0), n = tokens.shape(1);
            py::array_t<double> out({batch, n});
            const int64_t* ctx = contexts.data();
            const int64_t* off = offsets.data();
            const int64_t* tok = tokens.data();
            double* res = out.mutable_data();
            for (py::ssize_t b = 0; b < batch; ++b) {
              if (off[b] < 0 || off[b + 1] < off[b] || off[b + 1] > contexts.size()) {
                throw std::invalid_argument("context offsets out of range");
              }
            }
            for (py::ssize_t i = 0; i < contexts.size(); ++i) {
              if (ctx[i] < 0 || ctx[i] >= static_cast<int64_t>(kPadToken)) {
                throw std::invalid_argument("context token id out of range: " + std::to_string(ctx[i]));
              }
            }
            {
              py::gil_scoped_release release;
              std::vector<token_t> tail(kMaxOrder);
              NodeRef suffixes[kMaxOrder];
              for (py::ssize_t b = 0; b < batch; ++b) {
                const size_t len = static_cast<size_t>(off[b + 1] - off[b]);
                const size_t keep = std::min<size_t>(len, t.order() - 1);
                for (size_t i = 0; i < keep; ++i) tail[i] = static_cast<token_t>(ctx[off[b + 1] - keep + i]);
                const int ns = t.suffix_nodes(tail.data(), keep, suffixes);
                for (py::ssize_t j = 0; j < n; ++j) {
                  const int64_t x = tok[b * n + j];
                  res[b * n + j] = (x < 0 || x >= static_cast<int64_t>(kPadToken))
                                       ? 0.0
                                       : t.probability(suffixes, ns, static_cast<token_t>(x));
                }
              }
            }
            return out;
          },
          py::arg("contexts"), py::arg("offsets"), py::arg("tokens"))
      .def("check_structure", &MappedTrie::check_structure, py::call_guard<py::gil_scoped_release>());

  py::class_<SearchParams>(m, "SearchParams")
      .def(py::init([](int top_k, int beam_width, int max_depth, int budget, double level_weight_exponent,
                       double logit_weight_base, double ngram_weight, double epsilon, int64_t eos_token_id,
                       bool ngram_at_level0, bool use_ngram, int num_threads, double context_weight) {
             SearchParams p;
             p.top_k = top_k;
             p.beam_width = beam_width;
             p.max_depth = max_depth;
             p.budget = budget;
             p.level_weight_exponent = level_weight_exponent;
             p.logit_weight_base = logit_weight_base;
             p.ngram_weight = ngram_weight;
             p.epsilon = epsilon;
             p.eos_token_id = eos_token_id;
             p.ngram_at_level0 = ngram_at_level0;
             p.use_ngram = use_ngram;
             p.num_threads = num_threads;
             p.context_weight = context_weight;
             p.validate();
             return p;
           }),
           // no defaults here: ngram_service.tree_search.SearchParams holds them and passes every field
           py::kw_only(), py::arg("top_k"), py::arg("beam_width"), py::arg("max_depth"), py::arg("budget"),
           py::arg("level_weight_exponent"), py::arg("logit_weight_base"), py::arg("ngram_weight"),
           py::arg("epsilon"), py::arg("eos_token_id"), py::arg("ngram_at_level0"), py::arg("use_ngram"),
           py::arg("num_threads"), py::arg("context_weight"))
      .def_readonly("top_k", &SearchParams::top_k)
      .def_readonly("beam_width", &SearchParams::beam_width)
      .def_readonly("max_depth", &SearchParams::max_depth)
      .def_readonly("budget", &SearchParams::budget)
      .def_readonly("level_weight_exponent", &SearchParams::level_weight_exponent)
      .def_readonly("logit_weight_base", &SearchParams::logit_weight_base)
      .def_readonly("ngram_weight", &SearchParams::ngram_weight)
      .def_readonly("epsilon", &SearchParams::epsilon)
      .def_readonly("eos_token_id", &SearchParams::eos_token_id)
      .def_readonly("ngram_at_level0", &SearchParams::ngram_at_level0)
      .def_readonly("use_ngram", &SearchParams::use_ngram)
      .def_readonly("num_threads", &SearchParams::num_threads)
      .def_readonly("context_weight", &SearchParams::context_weight)
      .def("validate", &SearchParams::validate);

  m.def(
      "search_tree",
      [](const SearchParams& params, std::shared_ptr<MappedTrie> trie, const I64Array& ids, const F32Array& probs,
         const I64Array& context, const I64Array& chain, const F32Array& chain_probs) {
        check_topk(ids, probs, 2);
        if (context.ndim() != 1) throw std::invalid_argument("context must be 1-D");
        check_chain(chain, chain_probs);
        DraftTreeData t;
        {
          py::gil_scoped_release release;
          t = search_tree(params, trie.get(), ids.data(), probs.data(), static_cast<int>(ids.shape(0)),
                          static_cast<int>(ids.shape(1)), context.data(), static_cast<size_t>(context.size()),
                          chain.data(), chain_probs.data(), static_cast<size_t>(chain.size()));
        }
        return tree_to_dict(std::move(t));
      },
      py::arg("params"), py::arg("trie").none(true), py::arg("topk_ids"), py::arg("topk_probs"),
      py::arg("context"), py::arg("chain"), py::arg("chain_probs"));

  m.def(
      "search_trees",
      [](const SearchParams& params, std::shared_ptr<MappedTrie> trie, const I64Array& ids, const F32Array& probs,
         const I64Array& contexts, const I64Array& offsets, const I64Array& chains, const F32Array& chain_probs,
         const I64Array& chain_offsets) {
        std::vector<DraftTreeData> trees =
            search_batch(params, trie.get(), ids, probs, contexts, offsets, chains, chain_probs, chain_offsets, true);
        py::list out;
        for (auto& t : trees) out.append(tree_to_dict(std::move(t)));
        return out;
      },
      py::arg("params"), py::arg("trie").none(true), py::arg("topk_ids"), py::arg("topk_probs"),
      py::arg("contexts"), py::arg("context_offsets"), py::arg("chains"), py::arg("chain_probs"),
      py::arg("chain_offsets"));

  m.def(
      "search_trees_padded",
      [](const SearchParams& params, std::shared_ptr<MappedTrie> trie, const I64Array& ids, const F32Array& probs,
         const I64Array& contexts, const I64Array& offsets, const I64Array& chains, const F32Array& chain_probs,
         const I64Array& chain_offsets) {
        const auto batch = static_cast<size_t>(ids.ndim() == 3 ? ids.shape(0) : 0);
        std::vector<int64_t> tokens, counts(batch);
        std::vector<int32_t> parents, depths;
        std::vector<double> scores;
        std::vector<float> node_probs;
        size_t width = 1;
        {
          std::vector<DraftTreeData> trees = search_batch(params, trie.get(), ids, probs, contexts, offsets, chains,
                                                          chain_probs, chain_offsets, false);
          py::gil_scoped_release release;
          for (const auto& t : trees) width = std::max(width, t.tokens.size());
          tokens.assign(batch * width, 0);
          parents.assign(batch * width, 0);
          depths.assign(batch * width, 0);
          scores.assign(batch * width, 0.0);
          node_probs.assign(batch * width, 0.0f);
          for (size_t b = 0; b < batch; ++b) {
            const auto& t = trees[b];
            const size_t n = t.tokens.size(), at = b * width;
            counts[b] = static_cast<int64_t>(n);
            std::copy_n(t.tokens.data(), n, &tokens[at]);
            std::copy_n(t.parents.data(), n, &parents[at]);
            std::copy_n(t.depths.data(), n, &depths[at]);
            std::copy_n(t.scores.data(), n, &scores[at]);
            std::copy_n(t.probs.data(), n, &node_probs[at]);
          }
        }
        const auto b = static_cast<py::ssize_t>(batch), w = static_cast<py::ssize_t>(width);
        py::dict d;
        d["tokens"] = to_array(std::move(tokens), {b, w});
        d["parents"] = to_array(std::move(parents), {b, w});
        d["depths"] = to_array(std::move(depths), {b, w});
        d["scores"] = to_array(std::move(scores), {b, w});
        d["probs"] = to_array(std::move(node_probs), {b, w});
        d["counts"] = to_array(std::move(counts), {b});
        return d;
      },
      py::arg("params"), py::arg("trie").none(true), py::arg("topk_ids"), py::arg("topk_probs"),
      py::arg("contexts"), py::arg("context_offsets"), py::arg("chains"), py::arg("chain_probs"),
      py::arg("chain_offsets"),
      "search_trees' trees padded to the largest: a dict of [batch, N] arrays (tokens, parents with the root -1, "
      "depths, scores, probs; padding 0) and counts [batch], without the per-tree mask and retrieve indices.");

  m.def(
      "ancestor_masks",
      [](const I32Array& parents, const I64Array& counts) {
        check_rows_shape(parents, counts);
        const auto b = parents.shape(0), n = parents.shape(1);
        py::array_t<bool> mask({b, n, n});
        auto* out = reinterpret_cast<uint8_t*>(mask.mutable_data());
        {
          py::gil_scoped_release release;
          ancestor_masks(parents.data(), counts.data(), b, n, out);
        }
        return mask;
      },
      py::arg("parents"), py::arg("counts"),
      "[B, N, N] bool ancestor-or-self masks of a padded tree batch (parents [B, N] int32, counts [B]).");

  m.def(
      "path_values",
      [](const I32Array& parents, const I64Array& counts, const F64Array& scores, const F32Array& probs) {
        check_rows_shape(parents, counts);
        if (scores.ndim() != 2 || probs.ndim() != 2 || scores.shape(0) != parents.shape(0) ||
            scores.shape(1) != parents.shape(1) || probs.shape(0) != parents.shape(0) ||
            probs.shape(1) != parents.shape(1)) {
          throw std::invalid_argument("scores and probs must be [B, N] like parents");
        }
        const auto b = parents.shape(0), n = parents.shape(1);
        py::array_t<double> eff({b, n}), est({b, n});
        double* e = eff.mutable_data();
        double* p = est.mutable_data();
        {
          py::gil_scoped_release release;
          path_values(parents.data(), counts.data(), scores.data(), probs.data(), b, n, e, p);
        }
        return py::make_tuple(eff, est);
      },
      py::arg("parents"), py::arg("counts"), py::arg("scores"), py::arg("probs"),
      "(eff, est) [B, N] float64 of a padded tree batch: the lowest score and the product of probs along each "
      "node's path.");

  m.def(
      "select_nodes",
      [](const py::array_t<bool, py::array::c_style | py::array::forcecast>& keep, const I64Array& tokens,
         const I32Array& parents, const I32Array& depths, const F64Array& scores, const F32Array& probs,
         const I64Array& counts) {
        check_rows_shape(parents, counts);
        const auto b = parents.shape(0), n = parents.shape(1);
        for (const py::array* a : {static_cast<const py::array*>(&keep), static_cast<const py::array*>(&tokens),
                                   static_cast<const py::array*>(&depths), static_cast<const py::array*>(&scores),
                                   static_cast<const py::array*>(&probs)}) {
          if (a->ndim() != 2 || a->shape(0) != b || a->shape(1) != n) {
            throw std::invalid_argument("keep and the node arrays must be [B, N] like parents");
          }
        }
        const auto* k = reinterpret_cast<const uint8_t*>(keep.data());
        py::ssize_t width = 1;
        for (py::ssize_t r = 0; r < b; ++r) {
          const int64_t c = std::min<int64_t>(counts.data()[r], n);
          py::ssize_t kept = 0;
          for (int64_t i = 0; i < c; ++i) kept += k[r * n + i] != 0;
          width = std::max(width, kept);
        }
        I64Array out_tokens({b, width}), out_counts({b});
        I32Array out_parents({b, width}), out_depths({b, width});
        F64Array out_scores({b, width});
        F32Array out_probs({b, width});
        {
          py::gil_scoped_release release;
          select_nodes(k, tokens.data(), parents.data(), depths.data(), scores.data(), probs.data(), counts.data(),
                       b, n, width, out_tokens.mutable_data(), out_parents.mutable_data(), out_depths.mutable_data(),
                       out_scores.mutable_data(), out_probs.mutable_data(), out_counts.mutable_data());
        }
        return py::make_tuple(out_tokens, out_parents, out_depths, out_scores, out_probs, out_counts);
      },
      py::arg("keep"), py::arg("tokens"), py::arg("parents"), py::arg("depths"), py::arg("scores"), py::arg("probs"),
      py::arg("counts"),
      "A padded tree batch cut to the nodes where keep [B, N] is set: (tokens, parents, depths, scores, probs, "
      "counts), padded to the largest kept count.");

  py::class_<ContextIndex>(m, "ContextIndex")
      .def(py::init<int, size_t, int>(), py::arg("max_context"), py::arg("max_tokens"), py::arg("min_context") = 1)
      .def(
          "append",
          [](ContextIndex& c, const I64Array& tokens) {
            if (tokens.ndim() != 1) throw std::invalid_argument("tokens must be 1-D");
            c.append(tokens.data(), static_cast<size_t>(tokens.size()));
          },
          py::arg("tokens"))
      .def(
          "probability",
          [](const ContextIndex& c, const I64Array& extra, int64_t token) {
            if (extra.ndim() != 1) throw std::invalid_argument("extra must be 1-D");
            return c.probability(extra.data(), static_cast<size_t>(extra.size()), token);
          },
          py::arg("extra"), py::arg("token"))
      .def(
          "continuation",
          [](const ContextIndex& c, size_t max_len) {
            auto cont = c.continuation(max_len);
            const auto n = static_cast<py::ssize_t>(cont.tokens.size());
            std::vector<float> probs(cont.probs.begin(), cont.probs.end());
            return py::make_tuple(to_array(std::move(cont.tokens), {n}), to_array(std::move(probs), {n}),
                                  cont.match_length);
          },
          py::arg("max_len"))
      .def(
          "continuation_after",
          [](const ContextIndex& c, const I64Array& query, size_t max_len) {
            if (query.ndim() != 1) throw std::invalid_argument("query must be 1-D");
            auto cont = c.continuation_after(query.data(), static_cast<size_t>(query.size()), max_len);
            const auto n = static_cast<py::ssize_t>(cont.tokens.size());
            std::vector<float> probs(cont.probs.begin(), cont.probs.end());
            return py::make_tuple(to_array(std::move(cont.tokens), {n}), to_array(std::move(probs), {n}),
                                  cont.match_length);
          },
          py::arg("query"), py::arg("max_len"))
      .def_property_readonly("memory_bytes", &ContextIndex::memory_bytes)
      .def(
          "tokens",
          [](const ContextIndex& c, size_t start) {
            // the tokens from index `start` on (oldest first), copied once into the returned array
            const std::vector<int64_t>& all = c.tokens();
            const size_t from = std::min(start, all.size());
            py::array_t<int64_t> out(static_cast<py::ssize_t>(all.size() - from));
            std::copy(all.begin() + static_cast<std::ptrdiff_t>(from), all.end(), out.mutable_data());
            return out;
          },
          py::arg("start") = 0)
      .def_readonly_static("BOUNDARY", &ContextIndex::kBoundary)
      .def_property_readonly("size", &ContextIndex::size)
      .def_property_readonly("max_context", &ContextIndex::max_context)
      .def_property_readonly("min_context", &ContextIndex::min_context);

  py::class_<TrieBuilder>(m, "TrieBuilder")
      .def(py::init<int, uint32_t, std::string, uint64_t>(), py::arg("order"), py::arg("vocab_size"),
           py::arg("tmp_dir"), py::arg("memory_bytes"))
      .def(
          "add_documents",
          [](TrieBuilder& b, const U32Array& tokens, const I64Array& offsets) {
            if (tokens.ndim() != 1 || offsets.ndim() != 1 || offsets.shape(0) < 1) {
              throw std::invalid_argument("tokens must be 1-D and offsets [num_docs + 1]");
            }
            py::gil_scoped_release release;
            b.add_documents(tokens.data(), static_cast<size_t>(tokens.size()), offsets.data(),
                            static_cast<size_t>(offsets.shape(0) - 1));
          },
          py::arg("tokens"), py::arg("offsets"))
      .def(
          "finish",
          [](TrieBuilder& b, const std::string& path, const std::string& metadata_json, uint64_t min_count) {
            BuildStats s;
            {
              py::gil_scoped_release release;
              s = b.finish(path, metadata_json, min_count);
            }
            return build_stats(s);
          },
          py::arg("path"), py::arg("metadata_json"), py::arg("min_count"))
      .def(
          "add_counted",
          [](TrieBuilder& b, const U32Array& keys, const U64Array& counts) {
            if (keys.ndim() != 2 || counts.ndim() != 1 || keys.shape(0) != counts.shape(0)) {
              throw std::invalid_argument("keys must be [num_windows, order] and counts [num_windows]");
            }
            py::gil_scoped_release release;
            b.add_counted(keys.data(), counts.data(), static_cast<size_t>(counts.shape(0)));
          },
          py::arg("keys"), py::arg("counts"),
          "Adds counted windows (count_windows' output; keys [n, order] u32 padded with 2^32-1, counts [n]).")
      .def(
          "finish_levels",
          [](TrieBuilder& b, const std::string& prefix, uint64_t min_count) {
            BuildStats s;
            {
              py::gil_scoped_release release;
              s = b.finish_levels(prefix, min_count);
            }
            return build_stats(s);
          },
          py::arg("prefix"), py::arg("min_count"),
          "finish() into per-level stream files prefix+'level<m>.{tokens,counts,children}' instead of a trie file.");

  m.def(
      "count_windows",
      [](int order, uint32_t vocab_size, const U32Array& tokens, const I64Array& offsets, const U32Array& boundaries) {
        if (tokens.ndim() != 1 || offsets.ndim() != 1 || offsets.shape(0) < 1 || boundaries.ndim() != 1) {
          throw std::invalid_argument("tokens, offsets [num_docs + 1] and boundaries must be 1-D");
        }
        WindowRuns r;
        {
          py::gil_scoped_release release;
          r = count_windows(order, vocab_size, tokens.data(), static_cast<size_t>(tokens.size()), offsets.data(),
                            static_cast<size_t>(offsets.shape(0) - 1), boundaries.data(),
                            static_cast<size_t>(boundaries.size()));
        }
        const auto n = static_cast<py::ssize_t>(r.counts.size());
        const auto p = static_cast<py::ssize_t>(r.starts.size());
        return py::make_tuple(to_array(std::move(r.keys), {n, static_cast<py::ssize_t>(order)}),
                              to_array(std::move(r.counts), {n}), to_array(std::move(r.starts), {p}));
      },
      py::arg("order"), py::arg("vocab_size"), py::arg("tokens"), py::arg("offsets"), py::arg("boundaries"),
      "Sorted, counted windows of documents cut into key ranges by first token: (keys [n, order] u32, "
      "counts [n] u32, starts [partitions + 1] u64); see builder.hpp.");

  m.def(
      "write_levels_from_files",
      [](const std::string& path, const std::string& metadata_json, int order, uint32_t vocab_size,
         uint64_t total_tokens, const std::vector<std::string>& prefixes, const std::vector<uint64_t>& nodes_per_level,
         const std::vector<uint64_t>& max_count_per_level) {
        BuildStats s;
        {
          py::gil_scoped_release release;
          s = write_levels_from_files(path, metadata_json, order, vocab_size, total_tokens, prefixes, nodes_per_level,
                                      max_count_per_level);
        }
        return build_stats(s);
      },
      py::arg("path"), py::arg("metadata_json"), py::arg("order"), py::arg("vocab_size"), py::arg("total_tokens"),
      py::arg("prefixes"), py::arg("nodes_per_level"), py::arg("max_count_per_level"),
      "Lays out a trie file from level stream files (level_writer.hpp); checksums left zero.");

  m.def(
      "convert_reference_trie",
      [](const std::string& src, const std::string& dst, uint32_t vocab_size, const std::string& metadata_json,
         const std::string& tmp_dir, py::object progress) {
        std::function<void(uint64_t)> report;
        if (!progress.is_none()) {
          report = [progress](uint64_t done) {
            py::gil_scoped_acquire hold;
            progress(done);
          };
        }
        ConvertStats s;
        {
          py::gil_scoped_release release;
          s = convert_reference_trie(src, dst, vocab_size, metadata_json, tmp_dir, report);
        }
        py::dict d;
        d["order"] = s.order;
        d["source_nodes"] = s.source_nodes;
        d["source_bytes"] = s.source_bytes;
        d["nodes"] = s.nodes;
        d["zero_count_nodes"] = s.zero_count_nodes;
        d["above_parent"] = s.above_parent;
        d["flags"] = s.flags;
        d["total_tokens"] = s.total_tokens;
        d["nodes_per_level"] = s.nodes_per_level;
        d["file_bytes"] = s.file_bytes;
        return d;
      },
      py::arg("src"), py::arg("dst"), py::arg("vocab_size"), py::arg("metadata_json"), py::arg("tmp_dir"),
      py::arg("progress") = py::none(),
      "Converts a DART reference .trie into a trie file (reference_trie.hpp); raises ReferenceFormatError.");
}
