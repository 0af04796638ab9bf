// Greedy acceptance of a batch of draft trees on the CPU (dart_core.engine, verification on a CPU).
//
// Per tree, the walk of dart_core.verify.accept_greedy: from the root, the first child (in node
// order) whose token is the target's argmax at the current node is accepted and becomes the current
// node; the walk ends at a node with no such child, and the argmax there is the bonus token.  On a
// GPU the same result comes from dart_core.verify.accept_greedy_batch (tensor operations with no
// host read); on a CPU this loop over a few nodes per tree is what a dozen small PyTorch operators
// would otherwise cost.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

namespace py = pybind11;

namespace {

using I64 = py::array_t<int64_t, py::array::c_style>;

void accept_greedy(const I64& tokens, const I64& parents, const I64& num_nodes, const I64& argmax, I64 path,
                   I64 counts, I64 bonus) {
  if (tokens.ndim() != 2) throw std::invalid_argument("accept_greedy: tokens must be [B, N] int64");
  const py::ssize_t b = tokens.shape(0), n = tokens.shape(1);
  auto same = [&](const I64& a, const char* what) {
    if (a.ndim() != 2 || a.shape(0) != b || a.shape(1) != n)
      throw std::invalid_argument(std::string("accept_greedy: ") + what + " must be [B, N] int64 like tokens");
  };
  same(parents, "parents");
  same(argmax, "argmax");
  same(path, "path");
  if (num_nodes.ndim() != 1 || num_nodes.shape(0) != b || counts.ndim() != 1 || counts.shape(0) != b ||
      bonus.ndim() != 1 || bonus.shape(0) != b)
    throw std::invalid_argument("accept_greedy: num_nodes, counts and bonus must be [B] int64");
  const int64_t* tok = tokens.data();
  const int64_t* par = parents.data();
  const int64_t* nn = num_nodes.data();
  const int64_t* am = argmax.data();
  int64_t* out = path.mutable_data();
  int64_t* cnt = counts.mutable_data();
  int64_t* bon = bonus.mutable_data();
  for (py::ssize_t r = 0; r < b; ++r) {
    const int64_t m = nn[r];
    if (m < 1 || m > n)
      throw std::invalid_argument("accept_greedy: row " + std::to_string(r) + " has " + std::to_string(m) +
                                  " nodes, not 1 to " + std::to_string(n));
    const int64_t* t = tok + r * n;
    const int64_t* p = par + r * n;
    const int64_t* a = am + r * n;
    int64_t* row = out + r * n;
    for (py::ssize_t i = 0; i < n; ++i) row[i] = 0;
    int64_t cur = 0, len = 1;
    for (int64_t c = 1; c < m; ++c)  // children follow their parents: one pass in node order
      if (p[c] == cur && t[c] == a[cur]) row[len++] = cur = c;
    cnt[r] = len;
    bon[r] = a[cur];
  }
}

}  // namespace

void register_accept(py::module_& mod) {
  mod.def("accept_greedy", &accept_greedy, py::arg("tokens"), py::arg("parents"), py::arg("num_nodes"),
          py::arg("argmax"), py::arg("path").noconvert(), py::arg("counts").noconvert(), py::arg("bonus").noconvert(),
          "greedy acceptance of [B, N] draft trees (nodes in depth order): writes each tree's accepted path "
          "(node indices from the root, 0 past its count) to path [B, N], its length to counts [B] and the "
          "target's argmax at its last node to bonus [B], C-contiguous int64 arrays taken as they are (a "
          "converted copy would take the writes) (see dart_core.verify.accept_greedy)");
}
