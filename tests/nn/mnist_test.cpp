// MNIST / Fashion-MNIST loading: the real files on this machine, and corrupt files made here.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <type_traits>
#include <vector>

#include <ember/nn/data/data.h>
#include "tests/temp_dir.h"
#include "tests/tensor/test_util.h"

namespace ember::nn::data {
namespace {

using ember::test::expect_error;
using ember::test::TempDir;
namespace fs = std::filesystem;

// MNIST reads any IDX folder, so it names none by default; FashionMNIST defaults to this
// machine's copy.
static_assert(!std::is_default_constructible_v<MNIST>);
static_assert(std::is_default_constructible_v<FashionMNIST>);
static_assert(std::is_base_of_v<MNIST, FashionMNIST>);

bool have_fashion_mnist() {
  return fs::exists(fs::path(kFashionMnistRoot) / "train-images-idx3-ubyte.gz");
}

// Pixel (row, col) of image i, scaled back to its byte value.
int pixel(const Tensor& data, int64_t i, int64_t r, int64_t c) {
  return static_cast<int>(
      std::lround(data.select(0, i).select(0, 0).select(0, r).select(0, c).item<float>() * 255));
}

// Reference values below come from /usr/bin/python3 reading the same files with gzip + numpy:
//   im = np.frombuffer(gzip.open(path).read(), np.uint8, offset=16).reshape(-1, 28, 28)
//   lb = np.frombuffer(gzip.open(path).read(), np.uint8, offset=8)
// and np.float32(v) / np.float32(255) for the scaled values.
TEST(MNIST, ReadsFashionMnistTrain) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "no Fashion-MNIST under " << kFashionMnistRoot;
  const auto t0 = std::chrono::steady_clock::now();
  FashionMNIST ds;  // default root, train split
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[ MNIST    ] loaded 60000 training images in %.3f s\n", seconds);

  ASSERT_EQ(ds.size(), 60000);
  EXPECT_TRUE(ds.train());
  EXPECT_EQ(ds.data().shape(), Shape({60000, 1, 28, 28}));
  EXPECT_EQ(ds.data().dtype(), kFloat32);
  EXPECT_EQ(ds.targets().shape(), Shape({60000}));
  EXPECT_EQ(ds.targets().dtype(), kInt64);

  const std::vector<int64_t> labels = ds.targets().to_vector<int64_t>();
  const std::vector<int64_t> first12(labels.begin(), labels.begin() + 12);
  EXPECT_EQ(first12, (std::vector<int64_t>{9, 0, 0, 3, 0, 2, 7, 2, 5, 5, 0, 9}));
  std::vector<int64_t> counts(10, 0);
  for (int64_t l : labels) {
    ASSERT_TRUE(l >= 0 && l < 10) << "label " << l;
    counts[l]++;
  }
  EXPECT_EQ(counts, std::vector<int64_t>(10, 6000));

  EXPECT_EQ(pixel(ds.data(), 0, 14, 14), 217);
  EXPECT_EQ(pixel(ds.data(), 0, 5, 10), 0);
  EXPECT_EQ(pixel(ds.data(), 1, 12, 18), 212);
  EXPECT_EQ(pixel(ds.data(), 123, 10, 20), 59);
  EXPECT_EQ(pixel(ds.data(), 31337, 17, 2), 123);
  EXPECT_EQ(pixel(ds.data(), 59999, 15, 20), 92);
  // Bit-identical to ToTensor's float32 division.
  EXPECT_EQ(ds.data().select(0, 0).select(0, 0).select(0, 14).select(0, 14).item<float>(),
            0.850980401f);
  EXPECT_EQ(ds.data().select(0, 123).select(0, 0).select(0, 10).select(0, 20).item<float>(),
            0.23137255f);

  // Sum of every byte of the file: 3431114169.
  const float* px = ds.data().data<float>();
  int64_t total = 0;
  float lo = 1, hi = 0;
  for (int64_t i = 0; i < ds.data().numel(); ++i) {
    total += std::lround(px[i] * 255);
    lo = std::min(lo, px[i]);
    hi = std::max(hi, px[i]);
  }
  EXPECT_EQ(total, 3431114169);
  EXPECT_EQ(lo, 0.0f);
  EXPECT_EQ(hi, 1.0f);
}

TEST(MNIST, ReadsFashionMnistTestSplit) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "no Fashion-MNIST under " << kFashionMnistRoot;
  MNIST ds(kFashionMnistRoot, /*train=*/false);
  ASSERT_EQ(ds.size(), 10000);
  const std::vector<int64_t> labels = ds.targets().to_vector<int64_t>();
  EXPECT_EQ(std::vector<int64_t>(labels.begin(), labels.begin() + 12),
            (std::vector<int64_t>{9, 2, 1, 1, 6, 1, 4, 6, 5, 7, 4, 5}));
  EXPECT_EQ(pixel(ds.data(), 0, 14, 14), 110);
  EXPECT_EQ(pixel(ds.data(), 1, 20, 7), 114);
  EXPECT_EQ(pixel(ds.data(), 9999, 13, 13), 95);
  EXPECT_EQ(pixel(ds.data(), 123, 10, 20), 196);
  EXPECT_EQ(ds.data().select(0, 9999).select(0, 0).select(0, 13).select(0, 13).item<float>(),
            0.372549027f);
}

TEST(MNIST, Normalization) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "no Fashion-MNIST under " << kFashionMnistRoot;
  MNIST ds(kFashionMnistRoot, /*train=*/true, Normalization{0.2860, 0.3530});
  // /usr/bin/python3, as torchvision's Normalize computes it:
  //   x = torch.tensor(im[0].astype(np.float32)).div(255).unsqueeze(0)
  //   x.sub(torch.tensor([0.2860]).view(1, 1, 1)).div(torch.tensor([0.3530]).view(1, 1, 1))
  // at [0, 14, 14] and [0, 0, 0].
  const Tensor img = ds.data().select(0, 0).select(0, 0);
  EXPECT_EQ(img.select(0, 14).select(0, 14).item<float>(), 1.600511074066162f);
  EXPECT_EQ(img.select(0, 0).select(0, 0).item<float>(), -0.8101983666419983f);
  expect_error(
      [] {
        MNIST(kFashionMnistRoot, true, Normalization{0.5, 0.0});
      },
      {"[MNIST]", "std", "0"});
}

TEST(MNIST, DataLoaderEpoch) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "no Fashion-MNIST under " << kFashionMnistRoot;
  auto ds = std::make_shared<FashionMNIST>();
  DataLoader loader(ds, {.batch_size = 64, .shuffle = true, .seed = 1, .num_workers = 2});
  EXPECT_EQ(loader.size(), 938);
  const auto t0 = std::chrono::steady_clock::now();
  int64_t examples = 0, label_sum = 0, batches = 0;
  for (const Batch& b : loader) {
    if (batches == 0) {
      EXPECT_EQ(b.data.shape(), Shape({64, 1, 28, 28}));
      EXPECT_EQ(b.target.shape(), Shape({64}));
      // The first example is the first index of torch.randperm(60000, seed 1).
      const int64_t first = torch_randperm(60000, 1).front();
      EXPECT_TRUE(equal(b.data.select(0, 0), ds->data().select(0, first)));
      EXPECT_EQ(b.target.to_vector<int64_t>().front(), ds->targets().to_vector<int64_t>()[first]);
    }
    examples += b.data.size(0);
    for (int64_t l : b.target.to_vector<int64_t>()) label_sum += l;
    ++batches;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[ MNIST    ] one shuffled epoch of 938 batches in %.3f s\n", seconds);
  EXPECT_EQ(batches, 938);
  EXPECT_EQ(examples, 60000);
  EXPECT_EQ(label_sum, 270000);  // 6000 of each label 0..9
}

// ---- corrupt files --------------------------------------------------------------------------

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << "could not write " << path;
}

uint32_t crc32(const std::string& data) {
  uint32_t c = 0xffffffffu;
  for (unsigned char b : data) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1u)));
  }
  return ~c;
}

void put_le(std::string& s, uint32_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void put_be32(std::string& s, uint32_t v) {
  for (int i = 3; i >= 0; --i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// A valid gzip file holding `data` in stored (uncompressed) deflate blocks (RFC 1951/1952), so
// the test needs no zlib of its own.
std::string gzip_stored(const std::string& data) {
  std::string out = {'\x1f', '\x8b', '\x08', '\0', '\0', '\0', '\0', '\0', '\0', '\xff'};
  size_t pos = 0;
  do {
    const size_t len = std::min<size_t>(data.size() - pos, 65535);
    const bool last = pos + len == data.size();
    out.push_back(last ? '\x01' : '\x00');
    put_le(out, static_cast<uint32_t>(len), 2);
    put_le(out, static_cast<uint32_t>(~len & 0xffff), 2);
    out.append(data, pos, len);
    pos += len;
  } while (pos < data.size());
  put_le(out, crc32(data), 4);
  put_le(out, static_cast<uint32_t>(data.size()), 4);
  return out;
}

// IDX images: `n` images of rows x cols where pixel p of image i is (i * 7 + p) % 256; `pixels`
// overrides how many pixel bytes follow the header (-1: all).
std::string idx_images(uint32_t n, uint32_t rows = 28, uint32_t cols = 28, uint32_t magic = 0x803,
                       int64_t pixels = -1) {
  std::string s;
  put_be32(s, magic);
  put_be32(s, n);
  put_be32(s, rows);
  put_be32(s, cols);
  const int64_t count = pixels >= 0 ? pixels : int64_t{n} * rows * cols;
  for (int64_t k = 0; k < count; ++k) {
    const int64_t i = k / (rows * cols), p = k % (rows * cols);
    s.push_back(static_cast<char>((i * 7 + p) % 256));
  }
  return s;
}

std::string idx_labels(uint32_t n, uint32_t magic = 0x801) {
  std::string s;
  put_be32(s, magic);
  put_be32(s, n);
  for (uint32_t i = 0; i < n; ++i) s.push_back(static_cast<char>(i % 10));
  return s;
}

// Writes a split into dir: gzipped unless `gz` is false.
void write_split(const TempDir& dir, const std::string& prefix, const std::string& images,
                 const std::string& labels, bool gz = true) {
  const std::string suffix = gz ? ".gz" : "";
  write_file(dir.file(prefix + "-images-idx3-ubyte" + suffix), gz ? gzip_stored(images) : images);
  write_file(dir.file(prefix + "-labels-idx1-ubyte" + suffix), gz ? gzip_stored(labels) : labels);
}

TEST(MNISTFiles, ReadsSyntheticSplits) {
  TempDir dir;
  write_split(dir, "train", idx_images(3), idx_labels(3));
  write_split(dir, "t10k", idx_images(2), idx_labels(2));
  MNIST train(dir.path());
  ASSERT_EQ(train.size(), 3);
  EXPECT_EQ(pixel(train.data(), 2, 1, 3), (2 * 7 + 28 + 3) % 256);
  EXPECT_EQ(pixel(train.data(), 1, 27, 27), (7 + 783) % 256);
  EXPECT_EQ(train.data().select(0, 0).select(0, 0).select(0, 0).select(0, 5).item<float>(),
            5.0f / 255.0f);
  EXPECT_EQ(train.targets().to_vector<int64_t>(), (std::vector<int64_t>{0, 1, 2}));
  MNIST test(dir.path(), /*train=*/false);
  EXPECT_EQ(test.size(), 2);
  EXPECT_FALSE(test.train());

  // An empty split is valid.
  TempDir empty_dir;
  write_split(empty_dir, "train", idx_images(0), idx_labels(0));
  EXPECT_EQ(MNIST(empty_dir.path()).size(), 0);
}

TEST(MNISTFiles, ReadsUncompressedFiles) {
  TempDir dir;
  write_split(dir, "train", idx_images(4), idx_labels(4), /*gz=*/false);
  MNIST ds(dir.path());
  ASSERT_EQ(ds.size(), 4);
  EXPECT_EQ(pixel(ds.data(), 3, 0, 1), (3 * 7 + 1) % 256);
}

TEST(MNISTFiles, MissingFile) {
  TempDir dir;
  expect_error([&] { MNIST(dir.path()); },
               {"[MNIST]", "cannot open", dir.file("train-images-idx3-ubyte.gz")});
  write_file(dir.file("train-images-idx3-ubyte.gz"), gzip_stored(idx_images(2)));
  expect_error([&] { MNIST(dir.path()); },
               {"[MNIST]", "cannot open", dir.file("train-labels-idx1-ubyte.gz")});
  expect_error([&] { MNIST(dir.file("no/such/dir"), false); },
               {"[MNIST]", "t10k-images-idx3-ubyte.gz"});
}

TEST(MNISTFiles, TruncatedGzip) {
  TempDir dir;
  write_split(dir, "train", idx_images(5), idx_labels(5));
  const std::string gz = gzip_stored(idx_images(5));
  const std::string path = dir.file("train-images-idx3-ubyte.gz");
  write_file(path, gz.substr(0, gz.size() / 2));  // cut mid-stream
  expect_error([&] { MNIST(dir.path()); }, {"[MNIST]", "truncated", path});
  write_file(path, gz.substr(0, gz.size() - 3));  // cut inside the trailer
  expect_error([&] { MNIST(dir.path()); }, {"[MNIST]", "truncated", path});
  std::string bad_crc = gz;
  bad_crc[bad_crc.size() - 6] ^= 0x5a;
  write_file(path, bad_crc);
  expect_error([&] { MNIST(dir.path()); }, {"[MNIST]", "corrupt", path});
}

TEST(MNISTFiles, NotGzip) {
  TempDir dir;
  write_split(dir, "train", idx_images(2), idx_labels(2));
  const std::string path = dir.file("train-labels-idx1-ubyte.gz");
  write_file(path, idx_labels(2));  // raw IDX bytes under a .gz name
  expect_error([&] { MNIST(dir.path()); }, {"[MNIST]", path, "not a gzip file"});
}

TEST(MNISTFiles, BadMagic) {
  TempDir dir;
  write_split(dir, "train", idx_images(2, 28, 28, 0x804), idx_labels(2));
  expect_error([&] { MNIST(dir.path()); }, {"[MNIST]", dir.file("train-images-idx3-ubyte.gz"),
                                            "magic number 0x00000804", "expected 0x00000803"});
  write_split(dir, "train", idx_images(2), idx_labels(2, 0x803));
  expect_error([&] { MNIST(dir.path()); }, {"[MNIST]", dir.file("train-labels-idx1-ubyte.gz"),
                                            "magic number 0x00000803", "expected 0x00000801"});
}

TEST(MNISTFiles, CountMismatch) {
  TempDir dir;
  write_split(dir, "train", idx_images(5), idx_labels(4));
  expect_error([&] { MNIST(dir.path()); },
               {"[MNIST]", "count mismatch", "5 images", "4 labels",
                dir.file("train-images-idx3-ubyte.gz"), dir.file("train-labels-idx1-ubyte.gz")});
}

TEST(MNISTFiles, TruncatedPayloadAndTrailingBytes) {
  TempDir dir;
  write_split(dir, "train", idx_images(5, 28, 28, 0x803, 3 * 784 + 10), idx_labels(5));
  expect_error([&] { MNIST(dir.path()); },
               {"[MNIST]", dir.file("train-images-idx3-ubyte.gz"), "is truncated", "5 images",
                "3936 bytes", "2378 bytes"});
  write_split(dir, "train", idx_images(2), idx_labels(2).substr(0, 5));
  expect_error([&] { MNIST(dir.path()); },
               {"[MNIST]", dir.file("train-labels-idx1-ubyte.gz"), "truncated", "8-byte"});
  write_split(dir, "train", idx_images(2), idx_labels(2) + "xyz");
  expect_error([&] { MNIST(dir.path()); },
               {"[MNIST]", dir.file("train-labels-idx1-ubyte.gz"), "3 unexpected trailing"});
}

// A header that claims more than the file could ever hold is refused before anything is read
// or allocated for it (it once made the reader decompress and hold gigabytes).
TEST(MNISTFiles, HeaderClaimingMoreThanTheFileCanHoldIsRefusedUnread) {
  TempDir dir;
  write_split(dir, "train", idx_images(1000000000, 28, 28, 0x803, 2 * 784), idx_labels(2));
  expect_error([&] { MNIST(dir.path()); },
               {"[MNIST]", dir.file("train-images-idx3-ubyte.gz"), "1000000000 images",
                "784000000016 bytes", "can hold at most"});
  // Uncompressed: no more than the file's size.
  write_split(dir, "train", idx_images(2), idx_labels(2));
  std::filesystem::remove(dir.file("train-labels-idx1-ubyte.gz"));
  write_file(dir.file("train-labels-idx1-ubyte"), idx_labels(100000).substr(0, 8) + "xy");
  expect_error([&] { MNIST(dir.path()); },
               {"[MNIST]", dir.file("train-labels-idx1-ubyte"), "100000 labels", "at most 10 bytes"});
}

// Trailing data is counted only up to a bound: a payload followed by a decompression bomb fails
// without inflating it.
TEST(MNISTFiles, TrailingDataIsNotReadToTheEnd) {
  TempDir dir;
  write_split(dir, "train", idx_images(2), idx_labels(2) + std::string(200000, '\0'));
  expect_error([&] { MNIST(dir.path()); },
               {"[MNIST]", dir.file("train-labels-idx1-ubyte.gz"),
                "more than 65536 unexpected trailing bytes after its 2 labels"});
}

// Only regular files are read: a directory or a device in a file's place is named.
TEST(MNISTFiles, DirectoriesAndDevicesAreRefusedByName) {
  TempDir dir;
  write_split(dir, "train", idx_images(2), idx_labels(2));
  const std::string labels = dir.file("train-labels-idx1-ubyte.gz");
  std::filesystem::remove(labels);
  std::filesystem::create_directory(labels);
  expect_error([&] { MNIST(dir.path()); }, {"[MNIST]", labels, "is a directory"});
  std::filesystem::remove(labels);
  std::filesystem::create_symlink("/dev/zero", labels);
  expect_error([&] { MNIST(dir.path()); }, {"[MNIST]", labels, "not a regular file"});
}

TEST(MNISTFiles, WrongDims) {
  TempDir dir;
  write_split(dir, "train", idx_images(2, 32, 32), idx_labels(2));
  expect_error([&] { MNIST(dir.path()); },
               {"[MNIST]", dir.file("train-images-idx3-ubyte.gz"), "32x32", "expected 28x28"});
}

}  // namespace
}  // namespace ember::nn::data
