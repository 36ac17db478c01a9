#include <ember/tensor/cuda/runtime/cublas_loader.h>

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <string>

#include <ember/tensor/error.h>

namespace ember::detail {

namespace {

#define EMBER_CUBLAS_STRING2(x) #x
#define EMBER_CUBLAS_STRING(x) EMBER_CUBLAS_STRING2(x)

// The directory of the CUDA runtime this library was linked with: the toolkit's libraries are
// installed together, so cuBLAS is found there when the loader's search path lacks it.
std::string cudart_directory() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&cudaRuntimeGetVersion), &info) == 0 || !info.dli_fname) {
    return {};
  }
  const std::string path = info.dli_fname;
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string() : path.substr(0, slash);
}

void* open_library(const char* soname) {
  if (void* h = dlopen(soname, RTLD_NOW | RTLD_LOCAL)) return h;
  std::string why = dlerror();
  const std::string dir = cudart_directory();
  if (!dir.empty()) {
    const std::string path = dir + "/" + soname;
    if (void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL)) return h;
    why += "; then " + path + ": " + dlerror();
  }
  throw CudaError(str_cat("[cuBLAS] could not open ", soname, " (", why,
                          "); it is part of the CUDA toolkit Ember was built with (CUDA ",
                          CUBLAS_VER_MAJOR, "): install it or add its directory to "
                          "LD_LIBRARY_PATH"));
}

template <typename F>
void find(void* library, const char* soname, const char* symbol, F& out) {
  void* f = dlsym(library, symbol);
  if (f == nullptr) {
    throw CudaError(str_cat("[cuBLAS] ", soname, " has no ", symbol,
                            ": a cuBLAS other than the one Ember was built with (CUDA ",
                            CUBLAS_VER_MAJOR, ")?"));
  }
  out = reinterpret_cast<F>(f);
}

CublasFunctions open_cublas() {
  static constexpr const char* kLt = "libcublasLt.so." EMBER_CUBLAS_STRING(CUBLAS_VER_MAJOR);
  static constexpr const char* kBlas = "libcublas.so." EMBER_CUBLAS_STRING(CUBLAS_VER_MAJOR);
  // cuBLASLt first: cuBLAS needs it, and finds the one already loaded.
  void* lt = open_library(kLt);
  void* blas = open_library(kBlas);
  CublasFunctions f;
#define EMBER_CUBLAS_FIND(member, function, type) \
  find(blas, kBlas, EMBER_CUBLAS_STRING(function), f.member);
#define EMBER_CUBLASLT_FIND(member, function, type) \
  find(lt, kLt, EMBER_CUBLAS_STRING(function), f.member);
  EMBER_CUBLAS_FUNCTIONS(EMBER_CUBLAS_FIND)
  EMBER_CUBLASLT_FUNCTIONS(EMBER_CUBLASLT_FIND)
#undef EMBER_CUBLAS_FIND
#undef EMBER_CUBLASLT_FIND
  return f;  // the libraries stay open for the process's life
}

}  // namespace

const CublasFunctions& cublas() {
  static const CublasFunctions functions = open_cublas();  // a throw leaves it for the next call
  return functions;
}

}  // namespace ember::detail
