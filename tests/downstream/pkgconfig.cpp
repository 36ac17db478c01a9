// Built with only `pkg-config --cflags --libs ember`: the installed ember.pc is complete.
#include <cstdio>

#include <ember/tensor/ops.h>

int main() {
  const ember::Tensor t = ember::arange(0, 4, 1).to(ember::kFloat32);
  const double s = ember::sum(t * t).item<double>();
  std::printf("pkg-config: sum of squares %.0f\n", s);
  return s == 14.0 ? 0 : 1;
}
