// The tensor side of the autograd seam (tensor/detail/record.h): grad mode and the installed
// recording functions.
#include <ember/tensor/detail/record.h>

#include <vector>

#include <ember/tensor/error.h>

namespace ember {
namespace detail {

__thread bool t_grad_disabled = false;

namespace {
const AutogradHooks* g_hooks = nullptr;

[[noreturn]] void not_linked() {
  throw NotImplementedError(
      "[autograd] a tensor requires grad but the autograd library is not loaded; link "
      "ember_autograd");
}
void check_attrs(OpId op, const OpAttrs& attrs) {
  EMBER_INTERNAL_ASSERT(attrs.index() == attrs_index(op), "op #", static_cast<int>(op),
                        " recorded with attribute type #", attrs.index(), ", expected #",
                        attrs_index(op));
}
}  // namespace

void install_autograd_hooks(const AutogradHooks* hooks) { g_hooks = hooks; }

void record(OpId op, std::initializer_list<const Tensor*> inputs,
            std::initializer_list<Tensor*> outputs, OpAttrs attrs) {
  if (g_hooks == nullptr) not_linked();
  check_attrs(op, attrs);
  g_hooks->record(op, inputs.begin(), inputs.size(), outputs.begin(), outputs.size(), attrs);
}

void record_list(OpId op, const std::vector<Tensor>& inputs,
                 std::initializer_list<Tensor*> outputs, OpAttrs attrs) {
  if (g_hooks == nullptr) not_linked();
  check_attrs(op, attrs);
  std::vector<const Tensor*> ptrs;
  ptrs.reserve(inputs.size());
  for (const Tensor& t : inputs) ptrs.push_back(&t);
  g_hooks->record(op, ptrs.data(), ptrs.size(), outputs.begin(), outputs.size(), attrs);
}

void record_outputs(OpId op, const Tensor& input, std::vector<Tensor>& outputs, OpAttrs attrs) {
  if (g_hooks == nullptr) not_linked();
  check_attrs(op, attrs);
  const Tensor* in = &input;
  std::vector<Tensor*> ptrs;
  ptrs.reserve(outputs.size());
  for (Tensor& t : outputs) ptrs.push_back(&t);
  g_hooks->record(op, &in, 1, ptrs.data(), ptrs.size(), attrs);
}

void check_inplace(const Tensor& self, const char* op) {
  if (g_hooks == nullptr) not_linked();
  g_hooks->check_inplace(self, op);
}

}  // namespace detail
}  // namespace ember
