#include "strobe/logging/http_client.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <mutex>
#include <stdexcept>

#include <curl/curl.h>

namespace strobe::logging {
namespace {

size_t append_body(char* data, size_t size, size_t count, void* out) {
  static_cast<std::string*>(out)->append(data, size * count);
  return size * count;
}

}  // namespace

HttpClient::HttpClient(double timeout_s) : timeout_s_(timeout_s) {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  curl_ = curl_easy_init();
  if (!curl_) throw std::runtime_error("libcurl: curl_easy_init failed");
}

HttpClient::~HttpClient() {
  if (curl_) curl_easy_cleanup(static_cast<CURL*>(curl_));
}

HttpResponse HttpClient::request(const std::string& method, const std::string& url, const std::string& body,
                                 const std::string& content_type) {
  CURL* c = static_cast<CURL*>(curl_);
  curl_easy_reset(c);
  HttpResponse r;
  char error[CURL_ERROR_SIZE] = {0};
  curl_easy_setopt(c, CURLOPT_URL, url.c_str());
  curl_easy_setopt(c, CURLOPT_ERRORBUFFER, error);
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);  // timeouts without SIGALRM: safe on a background thread
  const long timeout_ms = std::max(1L, static_cast<long>(timeout_s_ * 1000));
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, timeout_ms);
  curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, std::min(timeout_ms, 5000L));
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, append_body);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &r.body);
  struct curl_slist* headers = nullptr;
  if (method != "GET") {
    headers = curl_slist_append(headers, ("Content-Type: " + content_type).c_str());
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method.c_str());
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, body.data());
    curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(body.size()));
  }
  headers = curl_slist_append(headers, "Expect:");  // no 100-continue round trip for large bodies
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers);
  const CURLcode rc = curl_easy_perform(c);
  curl_slist_free_all(headers);
  if (rc != CURLE_OK) {
    r.error = error[0] ? error : curl_easy_strerror(rc);
    r.status = 0;
    return r;
  }
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r.status);
  return r;
}

std::string HttpClient::escape(const std::string& text) {
  std::string out;
  for (unsigned char ch : text) {
    if (std::isalnum(ch) || ch == '-' || ch == '.' || ch == '_' || ch == '~') {
      out += static_cast<char>(ch);
    } else {
      char buf[4];
      std::snprintf(buf, sizeof buf, "%%%02X", ch);
      out += buf;
    }
  }
  return out;
}

}  // namespace strobe::logging
