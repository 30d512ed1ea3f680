// The calling thread's OpenMP threads let go. libgomp keeps a team of threads for each thread that ever ran a
// parallel region, and once it counts more of its threads than CPUs it stops spinning between regions: each of a
// step's ~200 regions then wakes its threads from sleep. A second engine's idle team beside a busy one (several
// models on one server) made a one-row decode step 4x slower on 2 CPUs; an engine lets its team go when it idles.

#include <ATen/ATen.h>
#include <torch/library.h>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

// True if the threads were let go (a later parallel region starts them again).
bool release_threads() {
#ifdef _OPENMP
  return omp_pause_resource_all(omp_pause_soft) == 0;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) { m.def("release_threads() -> bool", &release_threads); }
