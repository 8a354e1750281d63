// Starting the worker processes of a data-parallel job on this machine, as
// torchrun does for one node: N copies of a program, each with RANK,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT in
// its environment (header-only; tools only, never included by the library).
#pragma once

#include <arpa/inet.h>
#include <fmt/core.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace mha::tools {

/// A TCP port on 127.0.0.1 that was free a moment ago (the kernel's choice
/// for port 0), or 0 if none could be had. Another process may take it
/// before the job binds it; the job then fails to start, saying so.
inline int free_local_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) {
    return 0;
  }
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    port = ntohs(address.sin_port);
  }
  close(fd);
  return port;
}

/// How to start the workers of a one-machine job.
struct LocalLaunch {
  /// The program and its arguments, the same for every rank.
  std::vector<std::string> argv;
  int64_t nproc = 1;
  int master_port = 0;
  /// Set to worker_marker_value in every worker's environment, so that it
  /// knows it is one.
  std::string worker_marker;
  std::string worker_marker_value = "1";
  /// After the first worker fails, how long the others get to notice and
  /// exit by themselves before they are killed.
  std::chrono::milliseconds grace{10000};
  /// Prefix of the launcher's messages on stderr, e.g. "mha-train".
  std::string name = "launcher";
};

/// The environment of the current process without the variables of a
/// previous job, plus `extra` ("NAME=value" entries).
inline std::vector<std::string> worker_environment(
    const std::vector<std::string>& extra) {
  static const char* const kJobVariables[] = {
      "RANK=",        "WORLD_SIZE=", "LOCAL_RANK=", "LOCAL_WORLD_SIZE=",
      "MASTER_ADDR=", "MASTER_PORT="};
  std::vector<std::string> env;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    bool job_variable = false;
    for (const char* prefix : kJobVariables) {
      job_variable |= std::strncmp(*entry, prefix, std::strlen(prefix)) == 0;
    }
    if (!job_variable) {
      env.emplace_back(*entry);
    }
  }
  env.insert(env.end(), extra.begin(), extra.end());
  return env;
}

/// What a wait status says, e.g. "exited with status 1" or "was killed by
/// signal 9 (Killed)".
inline std::string describe_exit(int status) {
  if (WIFEXITED(status)) {
    return fmt::format("exited with status {}", WEXITSTATUS(status));
  }
  if (WIFSIGNALED(status)) {
    return fmt::format("was killed by signal {} ({})", WTERMSIG(status),
                       strsignal(WTERMSIG(status)));
  }
  return "stopped";
}

/// Starts launch.nproc copies of launch.argv (through /proc/self/exe when
/// argv[0] is this program) on 127.0.0.1:launch.master_port and waits for
/// them. When one fails, the others get launch.grace to exit on their own
/// (their next collective fails at once when a peer's connection closes),
/// then are killed. Returns 0 when every worker exited with 0; otherwise 2
/// when the first failure exited with 2 (bad arguments), else 1.
inline int run_local_workers(const LocalLaunch& launch) {
  std::map<pid_t, int64_t> running;  // pid -> rank
  std::vector<char*> argv;
  for (const auto& arg : launch.argv) {
    argv.push_back(const_cast<char*>(arg.c_str()));
  }
  argv.push_back(nullptr);
  int result = 0;
  for (int64_t rank = 0; rank < launch.nproc; ++rank) {
    const auto env_strings = worker_environment(
        {fmt::format("RANK={}", rank),
         fmt::format("WORLD_SIZE={}", launch.nproc),
         fmt::format("LOCAL_RANK={}", rank),
         fmt::format("LOCAL_WORLD_SIZE={}", launch.nproc),
         "MASTER_ADDR=127.0.0.1",
         fmt::format("MASTER_PORT={}", launch.master_port),
         launch.worker_marker + "=" + launch.worker_marker_value});
    std::vector<char*> env;
    for (const auto& entry : env_strings) {
      env.push_back(const_cast<char*>(entry.c_str()));
    }
    env.push_back(nullptr);
    pid_t pid = 0;
    const int error = posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr,
                                  argv.data(), env.data());
    if (error != 0) {
      fmt::print(stderr, "{}: cannot start worker rank {}: {}\n", launch.name,
                 rank, std::strerror(error));
      result = 1;
      break;
    }
    running[pid] = rank;
  }

  using Clock = std::chrono::steady_clock;
  std::optional<Clock::time_point> deadline;
  if (result != 0) {
    deadline = Clock::now();
  }
  while (!running.empty()) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, deadline ? WNOHANG : 0);
    if (pid > 0) {
      const auto it = running.find(pid);
      if (it == running.end()) {
        continue;
      }
      const int64_t rank = it->second;
      running.erase(it);
      const bool failed = !WIFEXITED(status) || WEXITSTATUS(status) != 0;
      if (failed && result == 0) {
        result = WIFEXITED(status) && WEXITSTATUS(status) == 2 ? 2 : 1;
        fmt::print(stderr, "{}: worker rank {} (pid {}) {}", launch.name, rank,
                   pid, describe_exit(status));
        if (!running.empty()) {
          fmt::print(stderr, "; the other ranks get {} s to stop",
                     launch.grace.count() / 1000.0);
        }
        fmt::print(stderr, "\n");
        deadline = Clock::now() + launch.grace;
      }
      continue;
    }
    if (pid < 0) {
      if (errno == EINTR) {
        continue;
      }
      break;  // no children left to wait for
    }
    if (Clock::now() >= *deadline) {
      for (const auto& [worker, rank] : running) {
        fmt::print(stderr,
                   "{}: worker rank {} (pid {}) still running; "
                   "killing it\n",
                   launch.name, rank, worker);
        kill(worker, SIGKILL);
      }
      deadline = Clock::time_point::max();  // reap without killing again
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return result;
}

}  // namespace mha::tools
