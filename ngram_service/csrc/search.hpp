// DART draft-tree search: beam search over the draft head's per-level top-k
// tokens, scored by the draft probabilities and an n-gram trie
// (DART, arXiv 2601.19278, "N-gram-enforced pruning"; docs/design.md §2).
//
//   score(child) = score(parent) + λ_l · (μ_l · log(p_draft + ε) + ν · log(p_ngram + ε))
//   λ_l = (l+1)^-level_weight_exponent,  μ_l = logit_weight_base^l
//
// Level l = 0..depth-1 extends every beam survivor of level l-1 (the root at
// level 0) with the top_k tokens of level l; the beam keeps beam_width
// candidates, EOS candidates ranked last and never extended.  After the last
// level the best `budget` candidates of all levels form the tree.  Ranking
// uses eff(c) = min(score(c), eff(parent)) with ties broken by depth then
// generation order, so a parent always ranks before its children and the
// tree is prefix-closed even when ε makes an increment slightly positive.
// Ties in the beam are broken by generation order (parent rank, then top-k
// column), which makes the result deterministic.
//
// Context continuation (docs/design.md §2, "Context in the tree"): a sequence
// may come with a chain c[0..L) and its context probabilities q[0..L) (what
// followed an earlier occurrence of the sequence's recent suffix, from its own
// context).  A candidate is on the chain when its parent is the root or on the
// chain and its token is c[depth - 1].  With κ = context_weight > 0, such a
// candidate is scored with
//   p_draft' = max(p_draft, κ·q),   p_ngram' = max(p_ngram, κ·q)
// in place of p_draft and p_ngram, and when the head's top-k of that level
// lacks c[l], the chain parent gets it as one more child (p_draft = 0 before
// the max): the chain enters the tree even where the draft head misses it.
// κ = 0 or no chain: exactly the search above.  Each node reports its
// acceptance estimate for the tree budget: p_draft, or max(p_draft, q) on the
// chain (κ ranks chain nodes; q, calibrated on its own, estimates them).
#pragma once

#include <cstdint>
#include <vector>

#include "trie.hpp"

namespace dart_ngram {

// Values come from the Python SearchParams (ngram_service/tree_search.py), the
// one place the defaults are written; every field is set there.
struct SearchParams {
  int top_k = 0;                       // draft tokens per level
  int beam_width = 0;                  // survivors per level
  int max_depth = 0;                   // levels searched (≤ the draft length d)
  int budget = 0;                      // draft nodes in the tree, root excluded
  double level_weight_exponent = 0;    // λ_l = (l+1)^-exponent
  double logit_weight_base = 0;        // μ_l = base^l
  double ngram_weight = 0;             // ν
  double epsilon = 0;                  // added before every log
  int64_t eos_token_id = -1;           // -1: no EOS handling
  bool ngram_at_level0 = false;        // the paper leaves level 0 to the draft head
  bool use_ngram = false;              // false: logits-only search (fallback)
  int num_threads = 0;                 // batched calls: sequences in parallel
  double context_weight = 0;           // κ: how far a context-continuation token is trusted (0: not used)

  void validate() const;  // throws std::invalid_argument
};

// One draft tree; node 0 is the root (the last accepted / bonus token) and
// nodes are ordered by depth, so every parent precedes its children.
struct DraftTreeData {
  std::vector<int64_t> tokens;    // [num_nodes]
  std::vector<int32_t> parents;   // [num_nodes], -1 for the root
  std::vector<int32_t> depths;    // [num_nodes], root 0 (position offsets)
  std::vector<double> scores;     // [num_nodes], root 0
  std::vector<float> probs;       // [num_nodes] acceptance estimate: p_draft, max(p_draft, q) on the chain; root 1
  std::vector<uint8_t> tree_mask; // [num_nodes, num_nodes], ancestor-or-self
  std::vector<int32_t> retrieve;  // [num_leaves, max_depth + 1], padded -1
  int32_t num_leaves = 0;
  int32_t max_depth = 0;
};

// topk_ids/topk_probs: [depth_in, k_in] row-major, columns by descending
// probability; context: [context_len] tokens ending with the root token.
// trie may be null (logits-only).  Throws std::invalid_argument on bad input.
// with_layout false: tree_mask and retrieve are left empty (a caller that builds them itself).
DraftTreeData search_tree(const SearchParams& params, const MappedTrie* trie, const int64_t* topk_ids,
                          const float* topk_probs, int depth_in, int k_in, const int64_t* context,
                          size_t context_len, const int64_t* chain = nullptr, const float* chain_probs = nullptr,
                          size_t chain_len = 0, bool with_layout = true);

// Batched: topk_*: [batch, depth_in, k_in]; contexts flattened, sequence b is
// contexts[offsets[b] .. offsets[b+1]).  Runs on params.num_threads threads.
// chains (optional): flattened like contexts, sequence b's is chains[chain_offsets[b] .. chain_offsets[b+1]).
std::vector<DraftTreeData> search_trees(const SearchParams& params, const MappedTrie* trie,
                                        const int64_t* topk_ids, const float* topk_probs, int batch,
                                        int depth_in, int k_in, const int64_t* contexts,
                                        const int64_t* context_offsets, const int64_t* chains = nullptr,
                                        const float* chain_probs = nullptr,
                                        const int64_t* chain_offsets = nullptr, bool with_layout = true);

// Padded batches of trees (ngram_service.tree_search.TreeBatch): row b's first counts[b] of n nodes
// are a tree in depth order (parents[b * n] = -1, every other parent before its node); the rest is
// padding.  Both throw std::invalid_argument for counts outside 1..n or a parent that does not precede
// its node.
// mask [batch, n, n]: 1 where column j is row i's node or one of its ancestors (padding: itself only).
void ancestor_masks(const int32_t* parents, const int64_t* counts, int64_t batch, int64_t n, uint8_t* mask);
// eff [batch, n]: the lowest score along each node's path (root +inf, padding -inf), the search's rank
// key; est [batch, n]: the product of probs along each node's path (root 1, padding 0).
void path_values(const int32_t* parents, const int64_t* counts, const double* scores, const float* probs,
                 int64_t batch, int64_t n, double* eff, double* est);

// Each row cut to its nodes with keep[b * n + i] set (padding ignored), re-indexed in order and written
// at width `width` (>= every row's kept count; padding 0, the root's parent -1) into the out_* arrays
// [batch, width]; out_counts [batch].  Throws std::invalid_argument for a row that drops its root or keeps
// a node without its parent, or as ancestor_masks.
void select_nodes(const uint8_t* keep, const int64_t* tokens, const int32_t* parents, const int32_t* depths,
                  const double* scores, const float* probs, const int64_t* counts, int64_t batch, int64_t n,
                  int64_t width, int64_t* out_tokens, int32_t* out_parents, int32_t* out_depths, double* out_scores,
                  float* out_probs, int64_t* out_counts);

}  // namespace dart_ngram
