#include "search.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>

namespace dart_ngram {

void SearchParams::validate() const {
  auto require = [](bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument("invalid search parameter: " + what);
  };
  require(top_k >= 1, "top_k must be >= 1, got " + std::to_string(top_k));
  require(beam_width >= 1, "beam_width must be >= 1, got " + std::to_string(beam_width));
  require(max_depth >= 1, "max_depth must be >= 1, got " + std::to_string(max_depth));
  require(budget >= 0, "budget must be >= 0, got " + std::to_string(budget));
  require(std::isfinite(level_weight_exponent), "level_weight_exponent must be finite");
  require(std::isfinite(logit_weight_base) && logit_weight_base > 0, "logit_weight_base must be > 0");
  require(std::isfinite(ngram_weight) && ngram_weight >= 0, "ngram_weight must be >= 0");
  require(std::isfinite(epsilon) && epsilon > 0, "epsilon must be > 0");
  require(num_threads >= 1, "num_threads must be >= 1, got " + std::to_string(num_threads));
  require(std::isfinite(context_weight) && context_weight >= 0, "context_weight must be >= 0");
}

namespace {

struct Candidate {
  int64_t token;
  int32_t parent;  // candidate index, -1 for the root
  int32_t depth;   // 1-based: level l has depth l+1
  double score;
  double eff;      // min(score, eff(parent))
  bool eos;
  bool chain;      // on the context continuation (parent on it or the root, token = chain[depth - 1])
  float prob;      // the draft probability the candidate was scored with
};

void check_token(int64_t tok, const char* what) {
  if (tok < 0 || tok >= static_cast<int64_t>(kPadToken)) {
    throw std::invalid_argument(std::string(what) + " token id " + std::to_string(tok) + " out of range");
  }
}

}  // namespace

DraftTreeData search_tree(const SearchParams& params, const MappedTrie* trie, const int64_t* topk_ids,
                          const float* topk_probs, int depth_in, int k_in, const int64_t* context,
                          size_t context_len, const int64_t* chain, const float* chain_probs, size_t chain_len,
                          bool with_layout) {
  params.validate();
  if (context_len == 0) throw std::invalid_argument("context must hold at least the root token");
  if (depth_in < 1 || k_in < 1) throw std::invalid_argument("top-k arrays must be at least [1, 1]");
  const int levels = std::min(params.max_depth, depth_in);
  const int k = std::min(params.top_k, k_in);
  for (int l = 0; l < levels; ++l) {
    for (int j = 0; j < k; ++j) {
      check_token(topk_ids[l * k_in + j], "draft");
      const float p = topk_probs[l * k_in + j];
      if (!(p >= 0.0f && p <= 1.0f)) {
        throw std::invalid_argument("draft probabilities must lie in [0, 1], got " + std::to_string(p));
      }
    }
  }
  const size_t chain_used = params.context_weight > 0 && chain != nullptr ? chain_len : 0;
  for (size_t i = 0; i < chain_used; ++i) {
    check_token(chain[i], "chain");
    if (!(chain_probs[i] >= 0.0f && chain_probs[i] <= 1.0f)) {
      throw std::invalid_argument("chain probabilities must lie in [0, 1], got " + std::to_string(chain_probs[i]));
    }
  }
  const bool ngram = params.use_ngram && trie != nullptr && params.ngram_weight > 0;
  const int order = trie != nullptr ? trie->order() : 0;
  if (ngram) {
    for (size_t i = context_len - std::min<size_t>(context_len, order - 1); i < context_len; ++i) {
      check_token(context[i], "context");
    }
  }

  std::vector<Candidate> cands;
  cands.reserve(static_cast<size_t>(levels) * params.beam_width * k + k);
  std::vector<int32_t> beam{-1};
  std::vector<int32_t> ranked;
  token_t tail[kMaxOrder];
  NodeRef suffixes[kMaxOrder];
  std::vector<token_t> level_tokens(k);
  std::vector<int> by_token(k);
  std::vector<double> p_ngram(k);
  token_t chain_token_sorted[1];
  int chain_order[1] = {0};
  double p_ngram_chain[1];

  for (int l = 0; l < levels; ++l) {
    const double lam = std::pow(static_cast<double>(l + 1), -params.level_weight_exponent);
    const double mu = std::pow(params.logit_weight_base, static_cast<double>(l));
    const bool ngram_here = ngram && (l > 0 || params.ngram_at_level0);
    const int32_t level_start = static_cast<int32_t>(cands.size());
    if (ngram_here) {  // the same k tokens follow every parent: sort them once per level
      for (int j = 0; j < k; ++j) {
        level_tokens[j] = static_cast<token_t>(topk_ids[l * k_in + j]);
        by_token[j] = j;
      }
      std::sort(by_token.begin(), by_token.end(), [&](int a, int b) { return level_tokens[a] < level_tokens[b]; });
    }
    for (int32_t p : beam) {
      if (p >= 0 && cands[p].eos) continue;
      int num_suffixes = 0;
      if (ngram_here) {
        // tail = last order-1 tokens of context + path(p).
        const int want = order - 1;
        int filled = 0;
        for (int32_t q = p; q >= 0 && filled < want; q = cands[q].parent) {
          tail[want - 1 - filled++] = static_cast<token_t>(cands[q].token);
        }
        for (size_t i = context_len; i > 0 && filled < want; --i) {
          tail[want - 1 - filled++] = static_cast<token_t>(context[i - 1]);
        }
        num_suffixes = trie->suffix_nodes(tail + (want - filled), filled, suffixes);
        trie->probabilities(suffixes, num_suffixes, level_tokens.data(), by_token.data(), k, p_ngram.data());
      }
      const double parent_score = p >= 0 ? cands[p].score : 0.0;
      const double parent_eff = p >= 0 ? cands[p].eff : std::numeric_limits<double>::infinity();
      // the context continuation's next token, when this parent is on the chain
      const bool on_chain = static_cast<size_t>(l) < chain_used && (p < 0 || cands[p].chain);
      const int64_t chain_tok = on_chain ? chain[l] : -1;
      const double chain_p = on_chain ? params.context_weight * static_cast<double>(chain_probs[l]) : 0.0;
      // a chain node's acceptance estimate (DraftTree.probs, what the adaptive budget prices) is its
      // evidence q itself, calibrated on its own; κ only sets how the search ranks it
      const float chain_q = on_chain ? chain_probs[l] : 0.0f;
      bool chain_seen = false;
      auto push = [&](int64_t tok, float p_draft, double p_ng) {
        const bool is_chain = tok == chain_tok;
        const float scored = is_chain ? static_cast<float>(std::max<double>(p_draft, chain_p)) : p_draft;
        const float prob = is_chain ? std::max(p_draft, chain_q) : p_draft;
        double inc = mu * std::log(static_cast<double>(scored) + params.epsilon);
        if (ngram_here) inc += params.ngram_weight * std::log((is_chain ? std::max(p_ng, chain_p) : p_ng) +
                                                              params.epsilon);
        const double score = parent_score + lam * inc;
        cands.push_back({tok, p, l + 1, score, std::min(score, parent_eff), tok == params.eos_token_id, is_chain,
                         prob});
        chain_seen = chain_seen || is_chain;
      };
      for (int j = 0; j < k; ++j) {
        push(topk_ids[l * k_in + j], topk_probs[l * k_in + j], ngram_here ? p_ngram[j] : 0.0);
      }
      if (on_chain && !chain_seen) {  // the head's top-k missed it: one more child
        double p_ng = 0.0;
        if (ngram_here) {
          chain_token_sorted[0] = static_cast<token_t>(chain_tok);
          trie->probabilities(suffixes, num_suffixes, chain_token_sorted, chain_order, 1, p_ngram_chain);
          p_ng = p_ngram_chain[0];
        }
        push(chain_tok, 0.0f, p_ng);
      }
    }
    // Beam: this level's candidates by (EOS last, score desc, generation order).
    ranked.resize(cands.size() - level_start);
    for (size_t i = 0; i < ranked.size(); ++i) ranked[i] = level_start + static_cast<int32_t>(i);
    const size_t keep = std::min<size_t>(ranked.size(), params.beam_width);
    std::partial_sort(ranked.begin(), ranked.begin() + keep, ranked.end(), [&](int32_t a, int32_t b) {
      if (cands[a].eos != cands[b].eos) return !cands[a].eos;
      if (cands[a].score != cands[b].score) return cands[a].score > cands[b].score;
      return a < b;
    });
    beam.assign(ranked.begin(), ranked.begin() + keep);
    if (beam.empty()) break;
  }

  // Tree: the best `budget` candidates of all levels by (eff desc, depth, order).
  ranked.resize(cands.size());
  for (size_t i = 0; i < ranked.size(); ++i) ranked[i] = static_cast<int32_t>(i);
  const size_t chosen = std::min<size_t>(ranked.size(), params.budget);
  std::partial_sort(ranked.begin(), ranked.begin() + chosen, ranked.end(), [&](int32_t a, int32_t b) {
    if (cands[a].eff != cands[b].eff) return cands[a].eff > cands[b].eff;
    if (cands[a].depth != cands[b].depth) return cands[a].depth < cands[b].depth;
    return a < b;
  });
  ranked.resize(chosen);
  // Node order: depth, then rank (stable sort keeps rank order within a depth).
  std::stable_sort(ranked.begin(), ranked.end(),
                   [&](int32_t a, int32_t b) { return cands[a].depth < cands[b].depth; });

  const size_t n = chosen + 1;
  DraftTreeData t;
  t.tokens.resize(n);
  t.parents.resize(n);
  t.depths.resize(n);
  t.scores.resize(n);
  t.probs.resize(n);
  if (with_layout) t.tree_mask.assign(n * n, 0);
  std::vector<int32_t> node_of(cands.size(), -1);
  std::vector<uint8_t> has_child(n, 0);
  t.tokens[0] = context[context_len - 1];
  t.parents[0] = -1;
  t.depths[0] = 0;
  t.scores[0] = 0.0;
  t.probs[0] = 1.0f;
  if (with_layout) t.tree_mask[0] = 1;
  for (size_t i = 1; i < n; ++i) {
    const Candidate& c = cands[ranked[i - 1]];
    node_of[ranked[i - 1]] = static_cast<int32_t>(i);
    const int32_t parent = c.parent < 0 ? 0 : node_of[c.parent];
    if (parent < 0) throw std::logic_error("draft tree is not prefix-closed");  // unreachable by construction
    t.tokens[i] = c.token;
    t.parents[i] = parent;
    t.depths[i] = c.depth;
    t.scores[i] = c.score;
    t.probs[i] = c.prob;
    has_child[parent] = 1;
    if (with_layout) {
      std::copy_n(&t.tree_mask[parent * n], n, &t.tree_mask[i * n]);
      t.tree_mask[i * n + i] = 1;
    }
    t.max_depth = std::max(t.max_depth, c.depth);
  }
  if (!with_layout) return t;
  const int32_t width = t.max_depth + 1;
  for (size_t i = 0; i < n; ++i) {
    if (has_child[i]) continue;
    const size_t row = t.retrieve.size();
    t.retrieve.resize(row + width, -1);
    for (int32_t v = static_cast<int32_t>(i); v >= 0; v = t.parents[v]) t.retrieve[row + t.depths[v]] = v;
    ++t.num_leaves;
  }
  return t;
}

std::vector<DraftTreeData> search_trees(const SearchParams& params, const MappedTrie* trie,
                                        const int64_t* topk_ids, const float* topk_probs, int batch,
                                        int depth_in, int k_in, const int64_t* contexts,
                                        const int64_t* context_offsets, const int64_t* chains,
                                        const float* chain_probs, const int64_t* chain_offsets,
                                        bool with_layout) {
  params.validate();
  if (batch < 0) throw std::invalid_argument("batch must be >= 0");
  for (int b = 0; b < batch; ++b) {
    if (context_offsets[b] < 0 || context_offsets[b + 1] <= context_offsets[b]) {
      throw std::invalid_argument("every sequence needs a non-empty context (offsets must increase)");
    }
  }
  if (chains != nullptr) {
    for (int b = 0; b < batch; ++b) {
      if (chain_offsets[b] < 0 || chain_offsets[b + 1] < chain_offsets[b]) {
        throw std::invalid_argument("chain offsets must not decrease");
      }
    }
  }
  std::vector<DraftTreeData> out(batch);
  const size_t stride = static_cast<size_t>(depth_in) * k_in;
  auto run_one = [&](int b) {
    const int64_t* chain = chains != nullptr ? chains + chain_offsets[b] : nullptr;
    const float* cprobs = chains != nullptr ? chain_probs + chain_offsets[b] : nullptr;
    const size_t clen = chains != nullptr ? static_cast<size_t>(chain_offsets[b + 1] - chain_offsets[b]) : 0;
    out[b] = search_tree(params, trie, topk_ids + b * stride, topk_probs + b * stride, depth_in, k_in,
                         contexts + context_offsets[b], context_offsets[b + 1] - context_offsets[b], chain, cprobs,
                         clen, with_layout);
  };
  const int threads = std::min(params.num_threads, batch);
  if (threads <= 1) {
    for (int b = 0; b < batch; ++b) run_one(b);
    return out;
  }
  std::atomic<int> next{0};
  std::vector<std::exception_ptr> errors(threads);
  std::vector<std::thread> pool;
  for (int w = 0; w < threads; ++w) {
    pool.emplace_back([&, w] {
      try {
        for (int b = next++; b < batch; b = next++) run_one(b);
      } catch (...) {
        errors[w] = std::current_exception();
        next = batch;
      }
    });
  }
  for (auto& th : pool) th.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  return out;
}

namespace {

void check_rows(const int32_t* parents, const int64_t* counts, int64_t batch, int64_t n) {
  for (int64_t b = 0; b < batch; ++b) {
    if (counts[b] < 1 || counts[b] > n) {
      throw std::invalid_argument("node counts must lie in 1.." + std::to_string(n) + ", got " +
                                  std::to_string(counts[b]));
    }
    const int32_t* p = parents + b * n;
    for (int64_t i = 1; i < counts[b]; ++i) {
      if (p[i] < 0 || p[i] >= i) throw std::invalid_argument("a draft tree node's parent must precede it");
    }
  }
}

}  // namespace

void ancestor_masks(const int32_t* parents, const int64_t* counts, int64_t batch, int64_t n, uint8_t* mask) {
  check_rows(parents, counts, batch, n);
  std::fill_n(mask, batch * n * n, uint8_t{0});
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t* p = parents + b * n;
    uint8_t* m = mask + b * n * n;
    for (int64_t i = 0; i < n; ++i) {
      if (i > 0 && i < counts[b]) std::copy_n(m + p[i] * n, i, m + i * n);  // the parent's row: only j < i are set
      m[i * n + i] = 1;
    }
  }
}

void path_values(const int32_t* parents, const int64_t* counts, const double* scores, const float* probs,
                 int64_t batch, int64_t n, double* eff, double* est) {
  check_rows(parents, counts, batch, n);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t at = b * n;
    eff[at] = std::numeric_limits<double>::infinity();
    est[at] = 1.0;
    for (int64_t i = 1; i < n; ++i) {
      if (i < counts[b]) {
        const int64_t up = at + parents[at + i];
        eff[at + i] = std::min(scores[at + i], eff[up]);
        est[at + i] = est[up] * static_cast<double>(probs[at + i]);
      } else {
        eff[at + i] = -std::numeric_limits<double>::infinity();
        est[at + i] = 0.0;
      }
    }
  }
}

void select_nodes(const uint8_t* keep, const int64_t* tokens, const int32_t* parents, const int32_t* depths,
                  const double* scores, const float* probs, const int64_t* counts, int64_t batch, int64_t n,
                  int64_t width, int64_t* out_tokens, int32_t* out_parents, int32_t* out_depths, double* out_scores,
                  float* out_probs, int64_t* out_counts) {
  check_rows(parents, counts, batch, n);
  std::vector<int32_t> new_of(static_cast<size_t>(n));
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t at = b * n, to = b * width;
    if (!keep[at]) throw std::invalid_argument("a subtree must keep the root");
    int32_t kept = 0;
    for (int64_t i = 0; i < counts[b]; ++i) {
      if (!keep[at + i]) {
        new_of[i] = -1;
        continue;
      }
      const int32_t parent = i == 0 ? -1 : new_of[parents[at + i]];
      if (i > 0 && parent < 0) {
        throw std::invalid_argument("a subtree must keep every kept node's parent (prefix-closed)");
      }
      if (kept >= width) throw std::invalid_argument("the selected rows do not fit the output width");
      new_of[i] = kept;
      out_tokens[to + kept] = tokens[at + i];
      out_parents[to + kept] = parent;
      out_depths[to + kept] = depths[at + i];
      out_scores[to + kept] = scores[at + i];
      out_probs[to + kept] = probs[at + i];
      ++kept;
    }
    std::fill(out_tokens + to + kept, out_tokens + to + width, int64_t{0});
    std::fill(out_parents + to + kept, out_parents + to + width, int32_t{0});
    std::fill(out_depths + to + kept, out_depths + to + width, int32_t{0});
    std::fill(out_scores + to + kept, out_scores + to + width, 0.0);
    std::fill(out_probs + to + kept, out_probs + to + width, 0.0f);
    out_counts[b] = kept;
  }
}

}  // namespace dart_ngram
