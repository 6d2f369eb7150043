// HttpClient: blocking HTTP(S) requests through libcurl (Debian's libcurl4-openssl-dev), for the
// MLflow logger's REST calls. libcurl rather than a header-only C++ library: it is on nearly every
// Linux machine already (the GPU machines' cmake links it), speaks https through the system's
// OpenSSL and honours the usual proxy variables (https_proxy, no_proxy), and its C ABI does not
// change with its version. One easy handle per client, so one client per thread.
#pragma once

#include <string>

namespace strobe::logging {

struct HttpResponse {
  long status = 0;    // the HTTP status; 0 when no response came (error says why)
  std::string body;
  std::string error;  // libcurl's message for a request that got no response ("" otherwise)
  bool ok() const { return status >= 200 && status < 300; }
};

class HttpClient {
 public:
  explicit HttpClient(double timeout_s);
  ~HttpClient();
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;
  // `method` GET, POST or PUT; `body` sent with `content_type` unless empty (GET).
  HttpResponse request(const std::string& method, const std::string& url, const std::string& body = "",
                       const std::string& content_type = "application/json");
  void set_timeout(double seconds) { timeout_s_ = seconds; }
  // `text` with every byte outside [A-Za-z0-9-._~] percent-encoded (a URL's query value).
  static std::string escape(const std::string& text);

 private:
  void* curl_ = nullptr;
  double timeout_s_;
};

}  // namespace strobe::logging
