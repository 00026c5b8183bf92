// The store model harness (store_model.h) on the CUDA backend: the same
// seeded random operations as on the CPU, with host views, against the
// same model (what succeeds, what a refusal leaves, the bytes stored, the
// bits of attention against a one-query decode in a fresh store).
#include <gtest/gtest.h>

#include "cuda_test_util.h"
#include "store_model.h"

namespace kvring {
namespace {

TEST(CudaStoreModel, RandomOperationsMatchTheModel) {
  KVRING_SKIP_WITHOUT_GPU();
  store_model::run_seeds(BackendKind::kCuda, store_model::Geometry::kFixed, 12, 400);
}

// Every operation with an error of the caller's pending on the thread (a
// failed cudaMalloc it never read): the store reports its own launches'
// errors, not the caller's, so the model's outcomes hold as they are.
TEST(CudaStoreModel, ACallersPendingErrorIsNotTheStores) {
  KVRING_SKIP_WITHOUT_GPU();
  store_model::run_seeds(BackendKind::kCuda, store_model::Geometry::kRandom, 6, 200,
                         [] { testing::leave_pending_error(); });
  (void)cudaGetLastError();
}

TEST(CudaStoreModel, RandomGeometriesMatchTheModel) {
  KVRING_SKIP_WITHOUT_GPU();
  store_model::run_seeds(BackendKind::kCuda, store_model::Geometry::kRandom, 24, 300);
}

}  // namespace
}  // namespace kvring
