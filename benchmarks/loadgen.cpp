// A closed-loop HTTP load generator for Triton's binary-tensor protocol, for
// the served GPU benchmark (bench_gpu_served.py) on nodes where perf_analyzer
// is not installed. A Python client costs tens of microseconds of CPU per
// request; on a 16-core node that serves tens of thousands of requests a
// second, Python clients take the cores the server is being measured on. This
// one costs a send and a receive.
//
//   loadgen HOST PORT MODEL BODIES CONNECTIONS SECONDS
//
// BODIES: requests encoded by clients/raw_http.encode_request, each as
// <u32 header length><u32 body length><body>, little-endian. Each connection
// (its own thread, one keep-alive socket) sends them in turn, waiting for each
// answer. Prints one JSON line: answered (HTTP 200) and failed requests, the
// seconds measured, latency percentiles (microseconds) and the generator's own
// CPU seconds.
//
// Built by bench_gpu_served.py with `g++ -O2 -pthread`
// (tests/unit/test_loadgen.py checks it against a real server).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

struct Result {
  int64_t ok = 0, failed = 0;
  std::vector<uint32_t> latency_us;
  std::string first_error;
};

int connect_to(const char *host, int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0)
    return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host, &a.sin_addr) != 1 ||
      connect(fd, reinterpret_cast<sockaddr *>(&a), sizeof a) != 0) {
    close(fd);
    return -1;
  }
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

bool send_all(int fd, const std::string &s) {
  size_t at = 0;
  while (at < s.size()) {
    const ssize_t n = send(fd, s.data() + at, s.size() - at, MSG_NOSIGNAL);
    if (n <= 0)
      return false;
    at += static_cast<size_t>(n);
  }
  return true;
}

// Reads one HTTP response (Content-Length framed); returns its status, or -1 on
// a broken connection or a response this generator cannot frame.
int read_response(int fd, std::string &buf, std::string *error) {
  size_t head_end;
  while ((head_end = buf.find("\r\n\r\n")) == std::string::npos) {
    char tmp[65536];
    const ssize_t n = recv(fd, tmp, sizeof tmp, 0);
    if (n <= 0)
      return -1;
    buf.append(tmp, static_cast<size_t>(n));
  }
  const std::string head = buf.substr(0, head_end);
  const int status = std::atoi(head.c_str() + head.find(' ') + 1);
  std::string lower = head;
  std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
  // at a line start: "inference-header-content-length:" ends the same way
  const size_t cl = lower.find("\r\ncontent-length:");
  if (cl == std::string::npos) {
    *error = "a response without Content-Length: " + head;
    return -1;
  }
  const size_t length = std::strtoull(head.c_str() + cl + 17, nullptr, 10);
  const size_t total = head_end + 4 + length;
  while (buf.size() < total) {
    char tmp[65536];
    const ssize_t n = recv(fd, tmp, sizeof tmp, 0);
    if (n <= 0)
      return -1;
    buf.append(tmp, static_cast<size_t>(n));
  }
  if (status != 200 && error->empty())
    *error = buf.substr(0, std::min<size_t>(total, 400));
  buf.erase(0, total);
  return status;
}

void run(const char *host, int port, const std::vector<std::string> *requests,
         size_t first, Clock::time_point end, Result *r) {
  const int fd = connect_to(host, port);
  if (fd < 0) {
    r->failed = 1;
    r->first_error = "cannot connect";
    return;
  }
  std::string buf;
  for (size_t i = first; Clock::now() < end; ++i) {
    const auto t0 = Clock::now();
    if (!send_all(fd, (*requests)[i % requests->size()])) {
      ++r->failed;
      r->first_error = "send failed";
      break;
    }
    const int status = read_response(fd, buf, &r->first_error);
    const auto us = std::chrono::duration_cast<std::chrono::microseconds>(
        Clock::now() - t0);
    if (status < 0) {
      ++r->failed;
      if (r->first_error.empty())
        r->first_error = "connection closed";
      break;
    }
    (status == 200 ? r->ok : r->failed) += 1;
    r->latency_us.push_back(static_cast<uint32_t>(us.count()));
  }
  close(fd);
}

} // namespace

int main(int argc, char **argv) {
  if (argc != 7) {
    std::fprintf(stderr,
                 "usage: loadgen HOST PORT MODEL BODIES CONNECTIONS SECONDS\n");
    return 2;
  }
  const char *host = argv[1];
  const int port = std::atoi(argv[2]);
  const std::string model = argv[3];
  const int connections = std::atoi(argv[5]);
  const double seconds = std::atof(argv[6]);
  std::ifstream in(argv[4], std::ios::binary);
  std::vector<std::string> requests;
  for (;;) {
    uint32_t sizes[2];
    if (!in.read(reinterpret_cast<char *>(sizes), sizeof sizes))
      break;
    std::string body(sizes[1], '\0');
    if (!in.read(&body[0], sizes[1])) {
      std::fprintf(stderr, "%s: truncated request\n", argv[4]);
      return 2;
    }
    requests.push_back("POST /v2/models/" + model +
                       "/infer HTTP/1.1\r\nHost: localhost\r\n"
                       "Content-Type: application/octet-stream\r\n"
                       "Inference-Header-Content-Length: " +
                       std::to_string(sizes[0]) + "\r\nContent-Length: " +
                       std::to_string(sizes[1]) + "\r\n\r\n" + body);
  }
  if (requests.empty() || connections < 1 || seconds <= 0) {
    std::fprintf(stderr,
                 "loadgen: no requests in %s, or bad connections/seconds\n",
                 argv[4]);
    return 2;
  }
  std::vector<Result> results(static_cast<size_t>(connections));
  std::vector<std::thread> threads;
  const auto start = Clock::now();
  const auto end = start + std::chrono::duration_cast<Clock::duration>(
                               std::chrono::duration<double>(seconds));
  for (int c = 0; c < connections; ++c) {
    threads.emplace_back(run, host, port, &requests, static_cast<size_t>(c) * 7,
                         end, &results[static_cast<size_t>(c)]);
  }
  for (auto &t : threads)
    t.join();
  const double elapsed =
      std::chrono::duration<double>(Clock::now() - start).count();
  Result all;
  for (auto &r : results) {
    all.ok += r.ok;
    all.failed += r.failed;
    all.latency_us.insert(all.latency_us.end(), r.latency_us.begin(),
                          r.latency_us.end());
    if (all.first_error.empty())
      all.first_error = r.first_error;
  }
  std::sort(all.latency_us.begin(), all.latency_us.end());
  auto pct = [&](double p) -> unsigned {
    if (all.latency_us.empty())
      return 0;
    return all
        .latency_us[std::min(all.latency_us.size() - 1,
                             static_cast<size_t>(p * all.latency_us.size()))];
  };
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  const double cpu = ru.ru_utime.tv_sec + ru.ru_stime.tv_sec +
                     (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
  std::string err;
  for (char ch : all.first_error) {
    if (ch == '"' || ch == '\\')
      err += '\\';
    err += (ch >= 32 && ch < 127) ? ch : ' ';
  }
  std::printf("{\"answered\": %lld, \"failed\": %lld, \"seconds\": %.4f, "
              "\"p50_us\": %u, \"p99_us\": %u, "
              "\"cpu_s\": %.3f, \"first_error\": \"%s\"}\n",
              static_cast<long long>(all.ok),
              static_cast<long long>(all.failed), elapsed, pct(0.5), pct(0.99),
              cpu, err.c_str());
  return 0;
}
