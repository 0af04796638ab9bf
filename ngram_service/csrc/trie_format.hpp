// On-disk layout of a dart-serve n-gram trie (format version 1).
//
// A trie of order n stores the counts of every m-gram (1 <= m <= n) of a
// corpus as n levels of sorted arrays, the way KenLM's sorted tries and
// suffix-array n-gram indexes do.  Level m holds one node per distinct
// m-gram, ordered lexicographically, which is the same as ordering by
// (parent node index, token).  Per level:
//
//   tokens   : u32[num_nodes]            last token of the m-gram
//   counts   : u32|u64[num_nodes]        occurrences of the m-gram
//   children : u32|u64[num_nodes + 1]    CSR offsets into level m+1
//                                        (absent on the last level)
//
// The children of node i of level m are nodes children[i] .. children[i+1]-1
// of level m+1, sorted by token, so a lookup is one binary search per level.
// Count and offset widths are chosen per level by the builder (4 bytes when
// the values fit), which gives ~8 bytes per node on the last level and ~12 on
// inner levels.  The file is read with mmap, so every process on the host
// shares one copy in the page cache (MappedTrie reads small files in at open).
//
// File = fixed header (352 bytes) | metadata JSON | padding to 64 | arrays.
// Every array starts at a multiple of 64.  Integers are little-endian.
// header_crc32 covers the header and metadata with that field zeroed;
// payload_crc32 covers every byte after header_bytes.  Both are CRC-32
// (zlib polynomial) and are written and checked by the Python layer.
//
// Version 2 is version 1 with `flags` in use; a file with no flag set is
// written as version 1, so every file an older reader can answer the same way
// stays readable there.  kFlagReferenceCounts marks counts imported from a
// pruned reference trie (reference_trie.hpp): a count may be 0 (no evidence:
// a lookup backs off past such a context or child) and a child's count may
// exceed its context's (the probability is clamped to 1).  Without the flag a
// zero count or a child above its parent is a corrupt file.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dart_ngram {

using token_t = uint32_t;

inline constexpr char kMagic[8] = {'D', 'A', 'R', 'T', 'T', 'R', 'I', 'E'};
inline constexpr uint32_t kFormatVersion = 1;         // files with flags == 0
inline constexpr uint32_t kFormatVersionFlags = 2;    // files with flags != 0
inline constexpr uint32_t kFlagReferenceCounts = 1u;  // see above
inline constexpr uint32_t kKnownFlags = kFlagReferenceCounts;
inline constexpr int kMinOrder = 2;
inline constexpr int kMaxOrder = 6;
inline constexpr token_t kPadToken = 0xFFFFFFFFu;  // never a real token id

struct LevelEntry {
  uint64_t num_nodes;
  uint64_t tokens_offset;    // byte offset from the start of the file
  uint64_t counts_offset;
  uint64_t children_offset;  // 0 on the last level
  uint32_t count_width;      // 4 or 8
  uint32_t child_width;      // 4 or 8; 0 on the last level
  uint64_t reserved;
};
static_assert(sizeof(LevelEntry) == 48, "LevelEntry layout");

struct FileHeader {
  char magic[8];
  uint32_t version;
  uint32_t header_bytes;    // fixed header + metadata JSON, padded to 64
  uint32_t order;
  uint32_t vocab_size;
  uint64_t total_tokens;    // count of the empty context
  uint64_t num_nodes;       // all levels together
  uint64_t file_bytes;
  uint32_t payload_crc32;
  uint32_t header_crc32;
  uint32_t metadata_bytes;  // JSON follows the fixed header
  uint32_t flags;           // 0 in version 1
  LevelEntry levels[kMaxOrder];
};
static_assert(sizeof(FileHeader) == 352, "FileHeader layout");

inline constexpr uint64_t kAlign = 64;
inline uint64_t align_up(uint64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

}  // namespace dart_ngram
